"""The per-batch schedule of one pass (paper Algorithm 1).

Contract: per batch ``t`` the driver submits, on every node::

    read(t + read_queue) ; train(t), returned(t) ; pull(t+1) ; load(t+1) ; write_back(t) ; refresh(t+1)

each stage an actor running one caller's calls in submission order, joined by four bounded
edges (:class:`BoundedEdge`) so a slow stage stalls its producer; ``train(t)`` also gets batch
``t+1``'s read so the trainer keeps the rows both need; under SSP and ASP no ``refresh`` is
submitted and a pass's last batch is written back by ``Trainer.settle``;
:meth:`PassSchedule.flush_trainers` makes the owners' copies current before a checkpoint, at a
stop and after a failure. Why this order is exact: docs/architecture.md, The pipeline,
One batch across nodes, The trainer's working set and Consistency (invariants 2 and 4).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import ray
from ray import ObjectRef

from hpsray.actors.messages import ReadBatch, TrainInputs
from hpsray.cluster import faults
from hpsray.cluster.updates import crosses_batches
from hpsray.errors import PeerFailedError, caused_by
from hpsray.pipelines.edge import BoundedEdge
from hpsray.pipelines.placement import NodeActors, wait_ready
from hpsray.pipelines.progress import Progress
from hpsray.pipelines.settings import SyncSettings

EDGES = ("read→pull", "pull→load", "load→train", "train→write-back")


@dataclass
class _Training:
    """A batch whose trainers were called but whose write-backs are not yet submitted."""

    batch_id: int
    results: list  # per borrower: refs of Returned per owner, then of TrainOutcome


@dataclass
class PassSchedule:
    """Drives one pass over the nodes' readers, from batch id ``first`` on.

    ``on_batch_end(batch_id, schedule)`` (optional) runs after batch ``batch_id``'s write-backs
    are submitted and before the next batch trains; :meth:`drain` there makes them done.
    ``refresh_alone``: refresh on one node too (feature admission: a key lent without a row
    that stays resident in the trainer must be reset; docs/architecture.md, Admission and expiry).
    ``pull_queue``, ``load_queue``, ``write_back_queue``: the capacities of the other three
    edges (``load_queue`` >= 2 lets ``t+1`` load while ``t`` trains).
    ``sync``: the pipeline's :class:`~hpsray.pipelines.SyncSettings` (``None``: BSP); under SSP and
    ASP the batches' ends are no barriers (see the module's docstring).
    """

    nodes: list[NodeActors]
    first: int
    read_queue: int
    on_batch_end: Callable[[int, PassSchedule], None] | None = None
    refresh_alone: bool = False
    pull_queue: int = 2
    load_queue: int = 2
    write_back_queue: int = 2
    sync: SyncSettings | None = None
    reads: list[BoundedEdge] = field(init=False)
    pulls: list[BoundedEdge] = field(init=False)  # by owner
    loads: list[BoundedEdge] = field(init=False)  # by borrower
    write_backs: list[BoundedEdge] = field(init=False)  # by owner
    outcomes: list = field(init=False, default_factory=list)  # every TrainOutcome ref, to find a failure's root
    fetches: list = field(init=False, default_factory=list)  # refs of Trainer.fetch_ahead calls not yet reaped
    examples_by_batch: dict[int, int] = field(init=False, default_factory=dict)
    _pending: deque[list[ObjectRef[ReadBatch]]] = field(init=False, default_factory=deque)  # read ahead, by node
    _training: _Training | None = field(init=False, default=None)
    _first: tuple[list[ReadBatch], list[list]] | None = field(init=False, default=None)  # batch 0 read and lent

    def __post_init__(self) -> None:
        n = len(self.nodes)

        def edges(k: int, capacity: int) -> list[BoundedEdge]:
            return [BoundedEdge(f"{EDGES[k]}[node {i}]" if n > 1 else EDGES[k], capacity) for i in range(n)]

        # every wait of the driver ends within the job's fault timeout, naming who is missing (issue 34)
        faults.configure(getattr(self.sync, "fault_timeout_s", None), self.nodes)
        self.reads = edges(0, self.read_queue)
        self.pulls = edges(1, self.pull_queue)
        self.loads = edges(2, self.load_queue)
        self.write_backs = edges(3, self.write_back_queue)
        self.crosses = n > 1 and crosses_batches(self.sync)
        # several nodes under BSP and A-BSP: t+1 is lent before t trains (the load edge must hold both)
        self.lend_first = n > 1 and not self.crosses and self.load_queue >= 2

    @property
    def batches(self) -> int:
        """Batches trained (their write-backs submitted)."""
        return len(self.examples_by_batch)

    @property
    def examples(self) -> int:
        return sum(self.examples_by_batch.values())

    @property
    def edges(self) -> list[BoundedEdge]:
        return [*self.reads, *self.pulls, *self.loads, *self.write_backs]

    def _read(self, t: int) -> None:
        row = []
        for node, edge in zip(self.nodes, self.reads):
            edge.wait_room()
            ref = node.reader.read.remote(self.first + t)
            edge.put([ref])
            row.append(ref)
        self._pending.append(row)

    def _next_read(self) -> tuple[list[ReadBatch], list[ObjectRef[ReadBatch]]]:
        """The oldest batch read ahead, by node, and the refs it came from; raises a reader's
        error (bad input, say)."""
        refs = self._pending.popleft()
        return faults.get(refs, "the readers' next batch"), refs

    def _lend(self, t: int, read: list[ReadBatch]) -> list[list]:
        """Refs of the loans of batch ``t``: ``[borrower][owner]``, every owner pulling and then
        loading in parallel (the load stage runs on the owner's SSD-PS actor)."""
        nodes, bid = self.nodes, self.first + t
        n = len(nodes)
        for edge in self.pulls:
            edge.wait_room()
        pulled = [[nodes[o].mem.pull.remote(bid, r.keys_by_owner[o], b) for o in range(n)] for b, r in enumerate(read)]
        for o, edge in enumerate(self.pulls):
            edge.put([pulled[b][o] for b in range(n)])
        for b, edge in enumerate(self.reads):
            edge.taken(pulled[b])
        for edge in self.loads:
            edge.wait_room()
        loans = [[nodes[o].ssd.load_missing.remote(bid, pulled[b][o]) for o in range(n)] for b in range(n)]
        for b, edge in enumerate(self.loads):
            edge.put(loans[b])
        for o, edge in enumerate(self.pulls):
            edge.taken([loans[b][o] for b in range(n)])
        return loans

    def _refresh(self, t: int) -> list[list]:
        nodes = self.nodes
        return [[nodes[o].mem.refresh.remote(self.first + t, b) for o in range(len(nodes))] for b in range(len(nodes))]

    def _train(
        self,
        t: int,
        read: list[ReadBatch],
        loans: list[list],
        refreshed: list[list] | None,
        next_read: list[ObjectRef[ReadBatch]] | None = None,
    ) -> list:
        """Submit batch ``t``'s training; each trainer keeps the rows batch ``t+1`` needs too
        (a ref to its ReadBatch, read ahead) unless the owners need them back: on one node they
        never do; with several (``next_read`` given, and ``t+1`` lent) each owner names them."""
        n = len(self.nodes)
        upcoming: list[ObjectRef[ReadBatch] | None] = [None] * n
        must: list[list[ObjectRef[np.ndarray]]] = [[] for _ in range(n)]
        if n == 1 and self._pending:
            upcoming = list(self._pending[0])
        elif next_read is not None:
            upcoming = list(next_read)
            nodes, bid = self.nodes, self.first + t + 1
            names = [node.mem.must_return.options(num_returns=n).remote(bid, n) for node in nodes]
            must = [[names[o][b] for o in range(n)] for b in range(n)]
        sizes = [r.examples for r in read]
        results = []
        self.reap_fetches()
        for edge in self.write_backs:
            edge.wait_room()
        for b, node in enumerate(self.nodes):
            inputs = TrainInputs(
                read[b].batch,
                read[b].keys_by_owner,
                loans[b],
                refreshed[b] if refreshed else [],
                sizes,
                upcoming[b],
                must[b],
                read[b].layout,
            )
            self.fetches.append(node.trainer.fetch_ahead.remote(self.first + t, inputs))  # while t-1 trains
            outcome = node.trainer.train.remote(self.first + t, inputs)
            back = node.trainer.returned.options(num_returns=n).remote(self.first + t)  # stored off train's thread
            refs = [*(back if n > 1 else [back]), outcome]
            results.append(refs)
            self.outcomes.append(refs[-1])
            self.loads[b].taken([refs[-1]])
        for edge in self.write_backs:
            edge.put([refs[-1] for refs in results])
        return results

    def start(self) -> None:
        """The pipeline's fill: submit the first ``read_queue`` reads and, once batch 0 is read,
        its pulls and loads. :meth:`run` calls it unless :meth:`begin` did; raises a reader's
        error, or ``ValueError`` when the source yields no examples."""
        if self._first is not None:
            return
        for k in range(self.read_queue):
            self._read(k)
        read, _ = self._next_read()
        if sum(r.examples for r in read) == 0:
            raise ValueError("the source produced no examples")
        self._first = (read, self._lend(0, read))

    def begin(self, prefill: bool) -> tuple[dict[str, float], float]:
        """Wait until the stage actors are up: ``(seconds until each stage was, from this call;
        the pass's clock origin, a time.perf_counter())``. With ``prefill`` the fill
        (:meth:`start`) is submitted as soon as the readers and owners are up, while the trainers
        may still be starting: the clock starts when they are up, or where the fill started if
        they were up by the time batch 0 was read and lent (docs/architecture.md, The pipeline)."""
        t = time.perf_counter()
        if not prefill:
            return wait_ready(self.nodes, since=t), time.perf_counter()
        ready = wait_ready(self.nodes, ("read", "pull", "load"), since=t)
        probes = [node.trainer.__ray_ready__.remote() for node in self.nodes]
        filled_from = time.perf_counter()
        self.start()
        done, _ = ray.wait(probes, num_returns=len(probes), timeout=0)
        ready.update(wait_ready(self.nodes, ("train",), since=t))
        return ready, filled_from if len(done) == len(probes) else time.perf_counter()

    def run(self, progress: Progress | None = None) -> None:
        """Train every batch the readers yield (raises the first error; see :meth:`salvage`)."""
        n = len(self.nodes)
        self.start()
        assert self._first is not None
        (read, loans), t = self._first, 0
        # a later pass under admission: the last pass's rows are still resident in the trainers
        refreshed = self._refresh(0) if self.refresh_alone and self.first > 0 else None
        while True:
            self._read(t + self.read_queue)  # before train(t): the trainer looks at batch t+1's keys
            if self.lend_first:  # t+1 lent before t trains: the owners can say which rows must come back
                try:
                    next_read, next_refs = self._next_read()
                except Exception:  # t+1 is bad: t still trains (every row back) and is salvaged
                    self._training = _Training(self.first + t, self._train(t, read, loans, refreshed))
                    raise
                more = sum(r.examples for r in next_read) > 0
                if more:
                    next_loans = self._lend(t + 1, next_read)
                results = self._train(t, read, loans, refreshed, next_refs if more else None)
                self._training = _Training(self.first + t, results)
            else:
                results = self._train(t, read, loans, refreshed)
                self._training = _Training(self.first + t, results)  # salvaged if reading t+1 fails
                next_read, _ = self._next_read()
                more = sum(r.examples for r in next_read) > 0
                if more:
                    next_loans = self._lend(t + 1, next_read)
            returned = results
            if self.crosses and not more:  # the pass's last batch: every update in before write-back
                bid = self.first + t
                returned = [node.trainer.settle.options(num_returns=n).remote(bid) for node in self.nodes]
            for o, node in enumerate(self.nodes):
                ref = node.mem.write_back.remote(self.first + t, *[returned[b][o] for b in range(n)])
                self.write_backs[o].taken([ref])
            self._training = None
            stale_loans = (n > 1 and not self.crosses) or self.refresh_alone
            refreshed = self._refresh(t + 1) if more and stale_loans else None
            done = sum(r.examples for r in read)
            self.examples_by_batch[self.first + t] = done
            if progress is not None:
                progress.update(done)
            if self.on_batch_end is not None:
                self.on_batch_end(self.first + t, self)
            if not more:
                break
            t += 1
            read, loans = next_read, next_loans
        self.drain()

    def drain(self) -> None:
        """Wait until every submitted write-back is done (raises their errors)."""
        for edge in self.write_backs:
            edge.drain()
        self.reap_fetches(wait=True)

    def reap_fetches(self, wait: bool = False) -> None:
        """Forget the trainers' finished ``fetch_ahead`` calls (``wait``: waiting up to 5 s for
        the rest, done once their batches trained). They never fail but with their actor, which
        ``train`` reports: so an error here is dropped, and none is left for Ray to report as
        unhandled."""
        if not self.fetches:
            return
        timeout = min(5.0, faults.fault_timeout()) if wait else 0
        done, self.fetches = ray.wait(self.fetches, num_returns=len(self.fetches), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001,S110 - the trainer's death is train's to report
                pass

    def flush_trainers(self) -> int:
        """Store the rows the trainers kept at the last batch's end (their owners' copies are
        stale until then; docs/architecture.md: The trainer's working set): before a
        checkpoint, at a stop, after a failure. Returns the rows stored."""
        flushed = [node.trainer.flush.remote() for node in self.nodes]
        stored = [node.mem.store_kept.remote(*flushed) for node in self.nodes]
        return sum(faults.get(stored, "the trainers' kept rows stored at their owners"))

    def salvage(self) -> int:
        """After a failure: finish the write-backs of every batch that trained, flush MEM-PS to
        SSD-PS, and return how many batches were saved (docs/architecture.md: invariant 7)."""
        nodes = self.nodes
        refs = [ref for edge in self.write_backs for ref in edge.in_flight()]
        saved = sum(edge.left for edge in self.write_backs)  # written back before the failure
        if self._training is not None:
            batch_id, results = self._training.batch_id, self._training.results
            refs += [node.mem.write_back.remote(batch_id, *[r[o] for r in results]) for o, node in enumerate(nodes)]
        # one deadline for them all: a write-back whose owner is gone is not waited for again
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=faults.fault_timeout()) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
                saved += 1
            except Exception:  # noqa: BLE001,S112 - that batch failed itself; its rows were never trained
                continue
        try:
            self.flush_trainers()
        except Exception:  # noqa: BLE001,S110 - a trainer is gone: what it kept is in the last checkpoint
            pass
        faults.get([node.mem.flush.remote() for node in nodes], "MEM-PS flushed after a failure")
        return saved // len(nodes)

    def first_failure(self, error: BaseException) -> BaseException:
        return first_failure(error, self.outcomes)


def first_failure(error: BaseException, outcomes: list) -> BaseException:
    """The error that stopped training: when trainers of other nodes failed only because one
    of them did (see :meth:`Trainer.train <hpsray.actors.trainer.Trainer.train>`), that one's
    error. ``outcomes`` are the trainers' outcome refs so far."""
    if not caused_by(error, PeerFailedError):
        return error
    done, _ = ray.wait(outcomes, num_returns=len(outcomes), timeout=0)
    finished = set(done)
    for ref in [r for r in outcomes if r in finished]:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - looking for the root cause
            if not caused_by(e, PeerFailedError):
                return e
    return error
