"""How a node's trainer steps through one batch: one strategy per mode, chosen once when the
trainers' group is joined (docs/architecture.md: One training step), behind one call per batch,
:meth:`Strategy.run_batch`.

- :class:`LocalSteps`: one node, a step per mini-batch;
- :class:`BspSteps`: BSP across nodes, every node's update applied at every global mini-batch;
- :class:`~hpsray.training.relaxed.RelaxedSteps`: SSP, A-BSP and ASP;
- :class:`~hpsray.training.devices.DeviceSteps`: ``D`` device processes per node.

A strategy takes the batch's inputs as the actor resolved them (or the error resolving them),
agrees with its peers that every one has them, makes the loans the working set (``borrow``), finds every key
once (``index``), runs the mini-batch steps, reads the loss once, and ends the batch (the rows
that leave, per owner). Collectives come in as typed collaborators; no strategy imports Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.errors import PeerFailedError
from hpsray.tiers.loans import Loan, Refresh
from hpsray.training.engine import SparseExchange, TrainerEngine
from hpsray.training.exchange_plan import ExchangePlan
from hpsray.training.layout import BatchIndex
from hpsray.training.marks import host_step, minibatch

__all__ = [
    "BatchData",
    "BatchResult",
    "BspSteps",
    "Collective",
    "DenseReduce",
    "KeepMasks",
    "LocalSteps",
    "Strategy",
]

DenseReduce = Callable[[torch.Tensor], torch.Tensor]
KeepMasks = Callable[[list[np.ndarray]], "list[np.ndarray] | None"]
"""Per owner, which of the batch's keys stay resident at its end (``None``: none)."""
Timed = Callable[[Hashable], AbstractContextManager[Any]]


class BatchData(Protocol):
    """A batch's inputs, resolved (``hpsray.actors.messages.TrainData``)."""

    @property
    def batch(self) -> Batch | None: ...
    @property
    def keys(self) -> list[np.ndarray]: ...
    @property
    def loans(self) -> list[Loan]: ...
    @property
    def refreshed(self) -> list[Refresh]: ...
    @property
    def layout(self) -> BatchIndex | None: ...


class Collective(SparseExchange, Protocol):
    """The trainers' collective group (``hpsray.cluster.collective.CollectiveGroup``)."""

    bytes_sent: int

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class BatchResult:
    """A strategy's result of one batch: per owner, ``(keys, rows)`` going back; the mean loss
    over its mini-batches; its examples; under SSP/ASP the ``(clock, oldest)`` stamp of the rows
    going back (``None``: no stamp)."""

    returned: list[tuple[np.ndarray, np.ndarray]]
    loss: float
    examples: int
    stamp: tuple[int, int] | None = None


def no_clock(batch_id: Hashable) -> AbstractContextManager[Any]:
    return nullcontext()


class Strategy:
    """One node's batches on ``engine`` (a trainer's mode); ``timed(batch_id)`` spans the work
    that counts as the batch's training time (the wait for the next batch's keys does not)."""

    def __init__(self, engine: TrainerEngine, timed: Timed = no_clock) -> None:
        self.engine, self.timed = engine, timed
        self.sent: list[int] = []  # per global mini-batch, this node's payload

    def run_batch(
        self, batch_id: Hashable, got: BatchData | BaseException, sizes: list[int], keep: KeepMasks
    ) -> BatchResult:
        """Train the batch ``got`` (its inputs, or the error resolving them; ``sizes``: every
        node's examples) and end it."""
        data = self.resolved(batch_id, got)
        engine = self.engine
        with self.timed(batch_id):
            with host_step("batch start"):
                engine.borrow(batch_id, data.keys, data.loans, data.refreshed)
                if data.batch is None:
                    index = engine.index(engine.empty)
                else:
                    index = engine.index(data.batch, data.layout)
            losses = self.steps(index, sizes)
            with host_step("loss"):
                loss = engine.close_batch(losses)  # the one read of the losses
        kept = keep(data.keys)  # may wait for the next batch's read
        with self.timed(batch_id), host_step("batch end"):
            back = engine.end_batch(batch_id, data.keys, kept)
            stamp = self.stamp(data.keys)
        engine.losses[batch_id] = loss
        return BatchResult(back, loss, index.n_examples, stamp)

    def resolved(self, batch_id: Hashable, got: BatchData | BaseException) -> BatchData:
        """The inputs, once every peer has its own: ``got``'s error is raised after telling the
        peers; a peer's failure raises :class:`PeerFailedError`."""
        error = got if isinstance(got, BaseException) else None
        if self.peer_failed(batch_id, error):
            raise PeerFailedError(batch_id)
        if isinstance(got, BaseException):
            raise got
        return got

    def peer_failed(self, batch_id: Hashable, error: BaseException | None) -> bool:
        """Whether another trainer failed ``batch_id`` (told of this one's ``error``)."""
        return False

    def steps(self, index: BatchIndex, sizes: list[int]) -> list[torch.Tensor]:
        """The mini-batch steps of the batch; their losses (device tensors, unread)."""
        return self.engine.train_local(index)

    def stamp(self, keys: Sequence[np.ndarray]) -> tuple[int, int] | None:
        return None

    @property
    def max_staleness(self) -> int:
        return 0

    def staleness(self) -> dict[str, int]:
        """The relaxed modes' staleness figures (0 elsewhere)."""
        return {"max_staleness": self.max_staleness, "max_staleness_across_batches": 0, "max_return_staleness": 0}

    def settle(self) -> list[tuple[np.ndarray, np.ndarray]]:
        raise RuntimeError(f"settle: only under ssp/asp, not {type(self).__name__}")

    def forget(self) -> None:
        """A recovery that keeps this process: the working set dropped."""
        self.engine.forget()

    def restart_clocks(self) -> None:
        """After a restore: every trainer of the group restarts from the restored step."""

    def close(self) -> None:
        """Let go of the collaborators (a re-formed group makes a new strategy)."""


class LocalSteps(Strategy):
    """One node: a step per mini-batch."""


class BspSteps(Strategy):
    """BSP across nodes: every node steps through as many global mini-batches as the node with
    the most examples (an exhausted node contributes empty ones); after each, ``reduce`` sums
    the dense gradient over the nodes and ``group`` gathers every node's row gradients, which
    each node applies to the rows it holds, summed in rank order. The rows each gradient goes to
    are resolved once per batch (:class:`~hpsray.training.exchange_plan.ExchangePlan`).
    ``before_step(clock)`` runs before each step (a seeded straggler delay)."""

    def __init__(
        self,
        engine: TrainerEngine,
        group: Collective,
        reduce: DenseReduce,
        before_step: Callable[[int], None] | None = None,
        timed: Timed = no_clock,
    ) -> None:
        super().__init__(engine, timed)
        self.group, self.reduce, self.before_step = group, reduce, before_step
        self._sent = group.bytes_sent

    def peer_failed(self, batch_id: Hashable, error: BaseException | None) -> bool:
        failed = self.group.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        return error is None and float(failed[0]) > 0

    def steps(self, index: BatchIndex, sizes: list[int]) -> list[torch.Tensor]:
        engine, group = self.engine, self.group
        engine.dense.train(True)
        arena, losses, dev = engine.arena, [], engine.device
        m = engine.config.minibatch_size
        own = [mb.keys for mb in index.minibatches if mb.keys is not None]
        with host_step("exchange plan"):
            plan = ExchangePlan.of(engine, own, max((-(-s // m) for s in sizes), default=0), group)
        for k, (mb, total) in enumerate(engine.global_minibatches(index, sizes)):
            if self.before_step is not None:
                self.before_step(engine.step + 1)
            with minibatch():
                if mb is not None:
                    gathered, loss, grads = engine.forward_backward(arena, mb, total)
                    assert mb.keys is not None  # indexed with keys: several nodes
                    keys = mb.keys
                else:
                    engine.dense.zero_grad()
                    keys = plan.no_keys
                    grads = torch.empty((0, engine.grad_dim), dtype=torch.float32, device=dev.torch)
                engine.dense.step_optimizers(self.reduce)
                _, all_grads = group.allgather_sparse(
                    engine.exchange_array(keys, keys=True), dev.from_tensor(grads), plan.counts(k)
                )
                engine.step += 1
                plan.apply(k, dev.tensor(all_grads), engine.step)
                if mb is not None:
                    losses.append(loss * total / mb.n_examples)
            self.sent.append(group.bytes_sent - self._sent)
            self._sent = group.bytes_sent
        engine.examples += index.n_examples
        return losses
