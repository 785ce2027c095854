"""The streaming engine of chunked aggregation: one event loop per worker (stripe) and rank
(docs/architecture.md: Chunked aggregation, the steps of a leader and of its node's other ranks).

Worker ``w`` drives every connection of stripe ``w`` (:mod:`aggregation_mesh`) with non-blocking
sockets, reads straight into the destination arrays (``recv_into``, no copies) and reduces each
chunk once complete, so chunk ``k + 1`` is on the wire while chunk ``k`` is summed. Worker 0 runs
in the caller's thread, the others in threads of their own (numpy and socket calls release the
GIL). A step ends when every result is in and every byte owed to a peer is sent, so no buffer of
the step is referenced afterwards.
"""

from __future__ import annotations

import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hpsray.cluster import faults
from hpsray.cluster.aggregation_mesh import Mesh
from hpsray.cluster.aggregation_topology import ELEMENT_BYTES, ChunkPlan
from hpsray.errors import DataPlaneError
from hpsray.models.dense_optim import DenseOptimizer

_HEADER = struct.Struct("<qq")  # step, n_elements
_H = _HEADER.size


class OwnerOptimizer:
    """The optimizer step of the chunks a rank owns, done where they are reduced (PHub).

    The owner steps its block in *segments*: runs of ``segment`` values (whole chunks) from the
    block's start, each stepped as soon as all its chunks are reduced, by its own ``torch.optim``
    optimizer (:func:`hpsray.models.dnn.make_dense_optimizer`) over that segment of the flat
    weights. The optimizers' math is element-wise, so the weights come out as the replicas'
    optimizers over the model's tensors make them (tested bit for bit); segments of several
    chunks keep torch's per-call cost (~0.1 ms) off every chunk.
    """

    def __init__(self, name: str, lr: float, segment: int) -> None:
        from hpsray.models.dnn import make_dense_optimizer

        make_dense_optimizer(name, [torch.nn.Parameter(torch.zeros(1))], lr)  # validates the name
        self.name, self.lr, self.segment = name, lr, segment
        self._make = make_dense_optimizer
        self._state: dict[tuple[int, int], tuple[torch.nn.Parameter, DenseOptimizer]] = {}

    def step(self, grad: np.ndarray, param: np.ndarray, a: int, b: int) -> None:
        """Update the segment ``param[a:b]`` in place with ``grad[a:b]``."""
        data = torch.from_numpy(param[a:b])
        entry = self._state.get((a, b))
        if entry is None:
            p = torch.nn.Parameter(data)
            entry = self._state[(a, b)] = (p, self._make(self.name, [p], self.lr))
        p, opt = entry
        p.data = data
        p.grad = torch.from_numpy(grad[a:b])
        opt.step()
        p.grad = None

    def state_dict(self) -> dict:
        """The optimizer state of every segment this rank stepped, by element range."""
        return {"segments": {ab: opt.state_dict() for ab, (_p, opt) in self._state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (of the same rank, plan, segment and optimizer)."""
        for (a, b), saved in state["segments"].items():
            p = torch.nn.Parameter(torch.zeros(b - a))
            opt = self._make(self.name, [p], self.lr)
            opt.load_state_dict(saved)
            self._state[(a, b)] = (p, opt)


class _Conn:
    """One connection's step: a header and a contiguous run of bytes each way, streamed."""

    __slots__ = ("sock", "fd", "peer", "hdr_out", "data_out", "limit", "sent", "hdr_in", "data_in", "received", "want")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.fd, self.peer = sock, sock.fileno(), peer
        self.hdr_in = bytearray(_H)

    def begin(self, step: int, n: int, send: np.ndarray, recv: np.ndarray) -> None:
        self.hdr_out = memoryview(_HEADER.pack(step, n))
        self.data_out = send.data.cast("B")
        self.limit = 0  # data bytes that may be sent so far
        self.sent = 0  # header included
        self.data_in = recv.data.cast("B")
        self.received = 0  # header included
        self.want = (step, n)

    @property
    def recv_elements(self) -> int:
        return max(self.received - _H, 0) // ELEMENT_BYTES

    def recv_pending(self) -> bool:
        return self.received < _H + len(self.data_in)

    def send_pending(self) -> bool:
        return self.sent < _H + self.limit

    def send_done(self) -> bool:
        return self.sent == _H + len(self.data_out)

    def send(self) -> bool:
        try:
            if self.sent < _H:
                n = self.sock.sendmsg([self.hdr_out[self.sent :], self.data_out[: self.limit]])
            else:
                n = self.sock.send(self.data_out[self.sent - _H : self.limit])
        except (BlockingIOError, InterruptedError):
            return False
        self.sent += n
        return n > 0

    def recv(self) -> bool:
        try:
            if self.received < _H:
                n = self.sock.recvmsg_into([memoryview(self.hdr_in)[self.received :], self.data_in])[0]
            else:
                n = self.sock.recv_into(self.data_in[self.received - _H :])
        except (BlockingIOError, InterruptedError):
            return False
        if n == 0:
            raise ConnectionError(f"aggregation: {self.peer} closed the connection")
        before = self.received
        self.received += n
        if before < _H <= self.received:
            got = _HEADER.unpack(self.hdr_in)
            if got != self.want:
                raise DataPlaneError(
                    f"aggregation: {self.peer}",
                    f"a header (step, n_elements) = {got} where this rank is at {self.want}: "
                    "every rank must reduce the same steps with gradients of the same length",
                )
        return True


class Stripe:
    """Worker ``worker``'s part of every step on one rank (docs/architecture.md: Chunked aggregation)."""

    def __init__(self, mesh: Mesh, worker: int, timeout_s: float) -> None:
        topo, rank = mesh.topology, mesh.rank
        self.topo, self.rank, self.worker, self.timeout_s = topo, rank, worker, timeout_s
        self.node = topo.node_of[rank]
        self.leader = topo.leader(self.node) == rank
        self.owner_out = {k: _Conn(s, f"node {k}'s leader") for k, s in sorted(mesh.owner_out[worker].items())}
        self.owner_in = {j: _Conn(s, f"node {j}'s leader") for j, s in sorted(mesh.owner_in[worker].items())}
        self.local = {r: _Conn(s, f"rank {r}") for r, s in sorted(mesh.local[worker].items())}
        up = mesh.up[worker]
        self.up = _Conn(up, f"rank {topo.leader(self.node)} (this node's leader)") if up is not None else None
        self.conns = [*self.owner_out.values(), *self.owner_in.values(), *self.local.values()]
        if self.up is not None:
            self.conns.append(self.up)
        self._poll = select.poll()
        self._polled: dict[int, int] = {}

    # -- one step ---------------------------------------------------------------------------------

    def run(
        self,
        step: int,
        plan: ChunkPlan,
        flat: np.ndarray,
        out: np.ndarray,
        bufs: dict,
        params: np.ndarray | None,
        opt: OwnerOptimizer | None,
    ) -> None:
        """Reduce this stripe of ``flat`` into ``out`` (with ``params`` and ``opt``: step the
        optimizer on the owned chunks and return weights instead of gradient sums)."""
        n = plan.n_elements
        blocks = self.topo.stripe(plan, self.worker)
        s_lo, s_hi = blocks[0][0], blocks[-1][1]
        self.plan, self.blocks, self.flat, self.out, self.params, self.opt = plan, blocks, flat, out, params, opt
        if not self.leader:
            up = self.up
            assert up is not None  # a member streams through its node's leader
            up.begin(step, n, flat[s_lo:s_hi], out[s_lo:s_hi])
            up.limit = (s_hi - s_lo) * ELEMENT_BYTES
            self._loop(step, self._done_member)
            return
        lo, hi = blocks[self.node]
        self.partial = bufs["partial"] if self.local else flat
        self.contrib = bufs["contrib"]
        self.localbuf = bufs["local"]
        self.gsum = bufs.get("gsum")
        for k, c in self.owner_out.items():
            c.begin(step, n, self.partial[blocks[k][0] : blocks[k][1]], out[blocks[k][0] : blocks[k][1]])
        for j, c in self.owner_in.items():
            c.begin(step, n, out[lo:hi], self.contrib[j][lo:hi])
        for r, c in self.local.items():
            c.begin(step, n, out[s_lo:s_hi], self.localbuf[r][s_lo:s_hi])
        self.s_lo, self.s_hi, self.lo, self.hi = s_lo, s_hi, lo, hi
        self.computed = s_lo if self.local else s_hi  # node sums ready up to here
        self.reduced = lo  # own block reduced up to here
        self.ready = lo  # own block's results ready (reduced, and stepped with an optimizer) up to here
        if not self.local:
            for c in self.owner_out.values():
                c.limit = len(c.data_out)
        self._loop(step, self._done_leader)

    def _progress(self) -> None:
        plan = self.plan
        if self.local:  # 1. this node's sum, as its ranks' values arrive
            m = min(c.recv_elements for c in self.local.values())
            ready = plan.chunk_floor(self.s_lo + m, self.s_hi)
            if ready > self.computed:
                a, b = self.computed, ready
                ranks = list(self.local)
                np.add(self.flat[a:b], self.localbuf[ranks[0]][a:b], out=self.partial[a:b])
                for r in ranks[1:]:
                    np.add(self.partial[a:b], self.localbuf[r][a:b], out=self.partial[a:b])
                self.computed = ready
                for k, c in self.owner_out.items():
                    k_lo, k_hi = self.blocks[k]
                    c.limit = (min(max(ready, k_lo), k_hi) - k_lo) * ELEMENT_BYTES
        lo, hi = self.lo, self.hi  # 2. the chunks this node owns, as the node sums arrive
        avail = min(max(self.computed, lo), hi)
        for c in self.owner_in.values():
            avail = min(avail, lo + c.recv_elements)
        avail = plan.chunk_floor(avail, hi)
        if avail > self.reduced:
            a, b = self.reduced, avail
            opt, gsum, params = self.opt, self.gsum, self.params
            if opt is None:
                dst = self.out
            else:  # run's buffers hold the summed gradient then
                assert gsum is not None
                dst = gsum
            srcs = [self.partial if k == self.node else self.contrib[k] for k in range(self.topo.n_nodes)]
            if len(srcs) == 1:
                np.copyto(dst[a:b], srcs[0][a:b])
            else:
                np.add(srcs[0][a:b], srcs[1][a:b], out=dst[a:b])
                for s in srcs[2:]:
                    np.add(dst[a:b], s[a:b], out=dst[a:b])
            self.reduced = b
            if opt is None:
                self.ready = b
            else:  # 2b. the optimizer, segment by segment once reduced
                assert params is not None  # run's weights, given with the optimizer
                while self.ready < b:
                    end = min(self.ready + opt.segment, hi)
                    if end > b:
                        break
                    np.copyto(self.out[self.ready : end], params[self.ready : end])
                    opt.step(dst, self.out, self.ready, end)
                    self.ready = end
            for c in self.owner_in.values():
                c.limit = (self.ready - lo) * ELEMENT_BYTES
        if self.local:  # 3. results, in order, to this node's other ranks
            pos = self.s_lo
            for k, (k_lo, k_hi) in enumerate(self.blocks):
                done = self.ready if k == self.node else k_lo + self.owner_out[k].recv_elements
                pos = done
                if done < k_hi:
                    break
            for c in self.local.values():
                c.limit = (pos - self.s_lo) * ELEMENT_BYTES

    def _done_leader(self) -> bool:
        return self.ready == self.hi and not any(c.recv_pending() or not c.send_done() for c in self.conns)

    def _done_member(self) -> bool:
        up = self.up
        assert up is not None
        return not up.recv_pending() and up.send_done()

    def _loop(self, step: int, done: Callable[[], bool]) -> None:
        conns, leader = self.conns, self.leader
        if leader:
            self._progress()
        last = time.monotonic()
        while True:
            moved = got = False
            for c in conns:
                if c.received < _H + len(c.data_in) and c.recv():
                    got = True
            if got and leader:
                self._progress()
            for c in conns:
                if c.sent < _H + c.limit and c.send():
                    moved = True
            if done():
                return
            if got or moved:
                last = time.monotonic()
                continue
            self._wait(step, last)

    def _wait(self, step: int, last: float) -> None:
        poll, polled = self._poll, self._polled
        for c in self.conns:
            mask = (select.POLLIN if c.recv_pending() else 0) | (select.POLLOUT if c.send_pending() else 0)
            if polled.get(c.fd, 0) != mask:
                if mask:
                    poll.register(c.fd, mask)
                    polled[c.fd] = mask
                else:
                    poll.unregister(c.fd)
                    polled.pop(c.fd)
        if not polled:
            raise RuntimeError(f"aggregation step {step}: nothing to wait for and not done (a bug)")
        events = poll.poll(min(1000, max(1, int(self.timeout_s * 1000))))
        for fd, ev in events:
            if ev & (select.POLLERR | select.POLLNVAL):
                peer = next((c.peer for c in self.conns if c.fd == fd), f"fd {fd}")
                raise ConnectionError(f"aggregation step {step}: the connection to {peer} failed")
        if not events and time.monotonic() - last > self.timeout_s:
            waiting = [c.peer for c in self.conns if c.recv_pending()]
            raise faults.expired(f"aggregation step {step}'s data from {waiting}", self.timeout_s)


class _Worker(threading.Thread):
    """Runs one stripe of every step in its own thread."""

    def __init__(self, stripe: Stripe, on_error: Callable[[BaseException], None]) -> None:
        super().__init__(name=f"hpsray-aggregation-{stripe.worker}", daemon=True)
        self.stripe, self.on_error = stripe, on_error
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self.stripe.run(*job)
                self.results.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.on_error(e)  # closes the connections: no peer (nor the caller's worker) waits on this one
                self.results.put(e)


class StreamEngine:
    """All workers of one rank: ``run(step, flat)`` returns the reduced ``flat`` (or, with
    ``params`` and an optimizer, the updated weights)."""

    def __init__(self, mesh: Mesh, chunk_bytes: int, timeout_s: float = faults.DEFAULT_FAULT_TIMEOUT_S) -> None:
        self.mesh, self.chunk_bytes = mesh, chunk_bytes
        self.stripes = [Stripe(mesh, w, timeout_s) for w in range(mesh.workers)]
        self.threads = [_Worker(s, self._fail) for s in self.stripes[1:]]
        for t in self.threads:
            t.start()
        self.plan: ChunkPlan | None = None
        self.bufs: dict = {}
        self.broken: BaseException | None = None
        self._lock = threading.Lock()

    def _fail(self, error: BaseException) -> None:
        """The first failure of a step is its cause; closing the connections at once makes the
        peers (and this rank's other workers) fail too, instead of waiting for it."""
        with self._lock:
            if self.broken is None:
                self.broken = error
        self.mesh.close()

    def _buffers(self, n: int, update: bool) -> tuple[ChunkPlan, dict]:
        if self.plan is None or self.plan.n_elements != n:
            topo, rank = self.mesh.topology, self.mesh.rank
            self.plan = topo.plan(n, self.mesh.workers, self.chunk_bytes)
            me = topo.node_of[rank]
            local = [r for r in topo.members(me) if r != rank] if topo.leader(me) == rank else []
            remote = [k for k in range(topo.n_nodes) if k != me] if topo.leader(me) == rank else []
            # full length for simple indexing; only the ranges this rank uses are ever written,
            # and a large np.empty's pages take memory only once written
            self.bufs = {
                "partial": np.empty(n, np.float32) if local else None,
                "local": {r: np.empty(n, np.float32) for r in local},
                "contrib": {k: np.empty(n, np.float32) for k in remote},
            }
        if update and "gsum" not in self.bufs:
            self.bufs["gsum"] = np.empty(n, np.float32)
        return self.plan, self.bufs

    def run(
        self, step: int, flat: np.ndarray, params: np.ndarray | None = None, opt: OwnerOptimizer | None = None
    ) -> np.ndarray:
        if self.broken is not None:
            raise RuntimeError("chunked aggregation failed earlier and cannot continue") from self.broken
        n = flat.shape[0]
        plan, bufs = self._buffers(n, opt is not None)
        out = np.empty(n, np.float32)
        job = (step, plan, flat, out, bufs, params, opt)
        for t in self.threads:
            t.jobs.put(job)
        try:
            self.stripes[0].run(*job)
        except BaseException as e:  # noqa: BLE001 - re-raised after the workers stop
            self._fail(e)
        for t in self.threads:
            t.results.get()
        if self.broken is not None:
            raise self.broken
        return out

    def close(self) -> None:
        for t in self.threads:
            t.jobs.put(None)
        self.mesh.close()
