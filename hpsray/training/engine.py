"""``TrainerEngine``: a node's trainer without Ray (docs/architecture.md: One training step).

The engine holds a node's state (working set, dense model, step) and the parts of a batch; a
strategy (:mod:`hpsray.training.strategies`) calls them, in order: :meth:`TrainerEngine.borrow`
(the loaned rows become the working set), :meth:`TrainerEngine.index` (every key occurrence
found once), the mini-batch steps (:meth:`TrainerEngine.train_local` on one node; torch ops on
the arena), :meth:`TrainerEngine.close_batch` (the one read of the losses) and
:meth:`TrainerEngine.end_batch` (the rows that leave, per owner). Collectives come in as the
strategies' collaborators, so the same engine trains one node in a test, in the actor, or beside
other engines in one process.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.errors import MissingRowsError
from hpsray.kernels.arrays import to_host
from hpsray.kernels.distinct import in_sorted
from hpsray.kernels.optim import HP_LR
from hpsray.models.device import StepDevice
from hpsray.models.kinds import build_model
from hpsray.models.pooling import BagLayout, bag_divisor, pool_sum, slot_columns
from hpsray.models.step import DenseReplicas
from hpsray.tables import with_first_order
from hpsray.tiers.grouped_hbm import GroupedHbmPS
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.loans import Loan, Refresh
from hpsray.tiers.rowgroups import RowGroups
from hpsray.training.grouped_step import GroupedArenaStep
from hpsray.training.layout import BatchIndex, MiniBatchIndex, index_batch, keys_as_tensor
from hpsray.training.marks import minibatch
from hpsray.training.step import ArenaStep
from hpsray.training.working_set import Traffic

__all__ = ["SparseExchange", "TrainerEngine", "loaned_rows"]


class SparseExchange(Protocol):
    """Every node's sparse update of a global mini-batch (a collective group, one rank per node)."""

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]:
        """Every rank's ``(uint64 keys, float32 grads)``, concatenated in rank order; ``counts``
        (every rank's number of keys, when the caller knows them) spares exchanging sizes."""
        ...


def loaned_rows(loans: list[Loan], key_parts: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(rows, held)`` of the owners' loans put together in owner order: ``rows`` of the keys
    shipped, ``held`` per key of all the owners' keys (``None``: none held)."""
    if not loans:
        return np.empty((0, width), np.float32), None
    rows = loans[0].rows if len(loans) == 1 else np.concatenate([loan.rows for loan in loans])
    if all(loan.held is None for loan in loans):
        return rows, None
    held = [np.zeros(k.size, bool) if ln.held is None else ln.held for ln, k in zip(loans, key_parts, strict=True)]
    return rows, np.concatenate(held)


class TrainerEngine:
    """One node's working set (an :class:`~hpsray.tiers.hbm.HbmPS` table), its dense model and
    the mini-batch step over them.

    Args:
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        capacity: rows the working set of two consecutive batches may hold.
        n_nodes: ``N``, for the device hash of the table.
        device: ``"cpu"`` or ``"cuda"``: where the table, the arena and the whole step live.
        model: ``(pooled [B, n_slots, dim], dense) -> logits``; the kind ``config`` names when ``None``.
    """

    def __init__(
        self,
        config: TrainConfig,
        n_slots: int,
        n_dense: int,
        capacity: int,
        n_nodes: int = 1,
        device: str = "cpu",
        model: torch.nn.Module | None = None,
    ) -> None:
        config = with_first_order(config, n_slots)  # a model of first-order rows: their table added
        self.config, self.n_dense = config, n_dense
        self.capacity, self.n_nodes = capacity, n_nodes
        self.device = StepDevice(device)
        self.optimizer = config.optimizer()
        tables = config.tables_for(n_slots) if config.tables else None
        self.n_slots = tables.n_slots if tables is not None else n_slots
        """The model's slots: the data's, then any copied ones (:mod:`hpsray.first_order`)."""
        groups = RowGroups.of(tables) if tables is not None else None
        # tables of several row layouts (own dim or sparse optimizer): the working set holds each
        # group's rows in its own table at its width, and each group steps with its own optimizer
        self.groups = groups if groups is not None and len(groups) > 1 else None
        self.row_width = config.row_width
        """Floats per row of the loans and returns the working set takes and gives (the widest group's)."""
        self.grad_dim = config.row_dim
        """Columns of a row gradient: the widest table's dim."""
        self.hbm = self._working_set()
        model = model if model is not None else build_model(config, n_slots, n_dense)
        self.dense = DenseReplicas(model, 1, config.dense_optimizer, config.dense_lr, self.device)
        self.step = 0  # mini-batch steps taken: the sparse optimizer's global step
        self.examples = 0
        self.traffic = Traffic(self.row_width * 4)
        self.losses: dict[Hashable, float] = {}  # per batch, its mean loss
        self.empty = Batch.empty(self.n_slots, n_dense)  # an exhausted node's part of a batch
        # the slots' widths differ: the model takes each slot's first dim columns of the pooled rows
        self.slot_cols = None
        if tables is not None and tables.uniform_dim is None:
            cols = slot_columns(tables.slot_dims, self.grad_dim)
            self.slot_cols = torch.as_tensor(cols, device=self.device.torch)
        self.group_optimizers = (
            tuple(tables.optimizers[ts[0]] for ts in self.groups.tables)
            if tables is not None and self.groups is not None
            else ()
        )
        means = tables.mean_slots if tables is not None else np.zeros(self.n_slots, bool)
        # the slots that pool by the mean (tables of their own), on the device; None: every slot sums
        self.mean_slots = torch.as_tensor(means, device=self.device.torch) if means.any() else None
        if groups is not None and len(groups) == 1:  # one layout: its optimizer (each table's lr below)
            self.optimizer = tables.optimizers[0] if tables is not None else self.optimizer
        self.lr_by_tag = None  # tables of their own learning rate: each by key tag (float32[256], on the device)
        own = [float(opt.hyperparams(1)[HP_LR]) for opt in tables.optimizers] if tables is not None else []
        if (
            tables is not None
            and tables.tagged
            and (self.groups is not None or set(own) != {float(self.optimizer.hyperparams(1)[HP_LR])})
        ):
            lrs = np.zeros(256, np.float32)
            lrs[: len(own)] = own
            self.lr_by_tag = torch.as_tensor(lrs, device=self.device.torch)
        self.kept: list[np.ndarray] = []  # per owner: keys kept at the last batch's end (not returned)
        self._resident: tuple[torch.Tensor, torch.Tensor] | None = None  # sorted int64 keys, their slots
        self._parts: list[np.ndarray] | None = None  # per owner, the sorted keys resident (the last batch's)
        self._arena: tuple[tuple[Any, ...], ArenaStep] | None = None  # (tables, their step): grown, new arenas

    def forget(self) -> None:
        """Drop the working set (a recovery that keeps this process; the dense model stays)."""
        self.hbm = self._working_set()
        self._arena, self._resident, self.kept, self._parts = None, None, [], None

    def _working_set(self) -> HbmPS | GroupedHbmPS:
        """An empty working set: one table, or one per row group at the group's width."""
        init, dev = self.config.row_init(), self.device.name
        if self.groups is not None:
            return GroupedHbmPS(self.groups, self.capacity, init, self.row_width, self.n_nodes, dev)
        return HbmPS(self.capacity, self.row_width, init, 1, self.n_nodes, dev)

    # -- a batch -----------------------------------------------------------------------------

    def borrow(
        self, batch_id: Any, key_parts: list[np.ndarray], loans: list[Loan], refreshed: Sequence[Refresh] = ()
    ) -> int:
        """Make the owners' loans for ``batch_id`` the working set (``key_parts[o]``: owner
        ``o``'s keys, sorted; ``loans[o]`` their rows but those held already); returns how many
        keys were resident."""
        keys = (
            key_parts[0] if len(key_parts) == 1 else np.concatenate(key_parts) if key_parts else np.empty(0, np.uint64)
        )
        rows, held = loaned_rows(loans, key_parts, self.row_width)
        before, self._parts = self._parts, None  # unknown until the borrow succeeds
        stale = None
        if before is not None and len(before) == len(key_parts):  # the keys resident now: the last batch's
            stale = np.concatenate([b[~in_sorted(b, k)] for b, k in zip(before, key_parts, strict=True)])
        hits = self.hbm.borrow(keys, rows, [(r.keys, r.rows) for r in refreshed], held, stale)
        if self.hbm.size != keys.size:  # a refreshed row outside the batch: find the residents again
            self.hbm.retain(keys)
        self._parts = key_parts
        self.traffic.received(batch_id, loans)
        self._resident = None
        if self.n_nodes > 1:
            self.set_resident(keys)
        return hits

    def set_resident(self, keys: np.ndarray) -> None:
        """Note ``keys`` as the working set's rows that updates of other nodes reach
        (:meth:`apply_updates`, :class:`~hpsray.training.exchange_plan.ExchangePlan`): sorted
        once, so an update finds its rows by ``searchsorted``."""
        self._resident = self._sorted_slots(keys)

    @property
    def resident(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys :meth:`set_resident` noted (``int64`` bits, sorted) and their slots."""
        return self._resident

    @property
    def arena(self) -> ArenaStep:
        """The sparse step over the tables' row arrays (torch views, no copy)."""
        tables: tuple[Any, ...] = tuple(self.hbm.tables)  # CpuHashTable or CudaHashTable: rows, row_keys
        if self._arena is None or any(a is not b for a, b in zip(self._arena[0], tables, strict=True)):
            views = [(self.device.tensor(t.rows), self.device.tensor(t.row_keys.view(np.int64))) for t in tables]
            lr = None
            if self.lr_by_tag is not None:  # tables of their own lr: each row's by its key's tag
                by_tag = self.lr_by_tag
                lr = lambda g, slots: by_tag[(views[g][1].index_select(0, slots) >> 56) & 255].unsqueeze(1)  # noqa: E731
            if isinstance(self.hbm, GroupedHbmPS):
                arenas = [v[0] for v in views]
                step: ArenaStep = GroupedArenaStep(arenas, self.hbm.bases, self.hbm.groups, self.group_optimizers, lr)
            else:
                row_lr = None if lr is None else (lambda slots, lr=lr: lr(0, slots))
                step = ArenaStep(views[0][0], self.grad_dim, self.optimizer, row_lr=row_lr)
            self._arena = (tables, step)
        return self._arena[1]

    def _find(self, keys: np.ndarray, on_device: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of resident ``keys`` as an int64 tensor on the device (one table probe)."""
        table = self.hbm.tables[0]
        if isinstance(self.hbm, GroupedHbmPS):  # one table per group: found on the host, global slots
            slots = torch.as_tensor(self.hbm.find(keys), device=self.device.torch)
        elif self.device.is_cuda:  # the keys are on the device already: probe them there
            xp = self.device.xp
            if on_device is None:
                on_device = keys_as_tensor(keys, self.device.torch)
            slots = torch.as_tensor(table.find(xp.asarray(on_device).view(xp.uint64)), device=self.device.torch)
        else:
            slots = torch.from_numpy(table.find(keys))
        missing = slots < 0
        if bool(missing.any()):  # a batch-boundary check: one read per batch
            first = int(keys[int(torch.nonzero(missing)[0, 0])])
            raise MissingRowsError(int(missing.sum()), int(keys.size), first)
        return slots.long()

    def _sorted_slots(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The working set's keys (int64 bits, sorted) and their slots, for :meth:`apply_updates`."""
        on = keys_as_tensor(keys, self.device.torch)
        slots = self._find(keys, on)
        order = torch.argsort(on)
        return on.index_select(0, order), slots.index_select(0, order)

    def stage(self, layout: BatchIndex) -> BatchIndex:
        """``layout`` (the read stage's) made ready for :meth:`index` to upload with no host work
        (:meth:`BatchIndex.staged`); on any thread, before the batch's turn."""
        return layout.staged(self.device.torch)

    def index(self, batch: Batch, layout: BatchIndex | None = None) -> BatchIndex:
        """``batch`` resolved against the working set: find once per batch. ``layout``: the
        batch's layout over the positions of the keys just borrowed (:func:`index_positions`,
        made by the read stage); then only the distinct keys are found, and the layout gathers
        their slots (no probe of every occurrence, no sort here)."""
        if batch.n_slots != self.n_slots or batch.n_dense != self.n_dense:
            raise ValueError(
                f"batch has {batch.n_slots} slots and {batch.n_dense} dense features; "
                f"the trainer was built for {self.n_slots} and {self.n_dense}"
            )
        if layout is not None and self._parts is not None:
            parts = self._parts
            keys = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.uint64)
            on = keys_as_tensor(keys, self.device.torch)
            return layout.at_slots(self._find(keys, on), on if self.n_nodes > 1 else None, self.device.torch)
        return index_batch(
            batch, self.config.minibatch_size, self._find, self.arena.capacity, self.device.torch, self.n_nodes > 1
        )

    def train_local(self, index: BatchIndex) -> list[torch.Tensor]:
        """One node: a step per mini-batch; returns the losses (device tensors, unread)."""
        self.dense.train(True)
        arena, losses = self.arena, []
        for mb in index.minibatches:
            with minibatch():  # a profiler range: tests count what runs inside it
                gathered = arena.gather(mb.rows)
                loss, pooled = self.backward_pooled(gathered, mb, mb.n_examples)
                self.dense.step_optimizers()
                self.step += 1
                arena.apply(mb, gathered, pooled, self.step)  # fused on the CPU: ArenaStep
                losses.append(loss)
        self.examples += index.n_examples
        return losses

    def close_batch(self, losses: list[torch.Tensor]) -> float:
        """The batch's mean loss: the one read of the device per batch (``nan`` without steps)."""
        return float(torch.stack(losses).sum()) / len(losses) if losses else float("nan")

    @torch.no_grad()
    def predict(self, batch: Batch, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Click probabilities of ``batch`` given the current ``rows`` of ``keys`` (any order)."""
        order = np.argsort(keys)
        keys, rows = keys[order], rows[order]
        model = self.dense.models[0]
        model.eval()
        out = []
        dim, dev = self.grad_dim, self.device
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = dev.tensor(np.ascontiguousarray(rows[np.searchsorted(keys, layout.unique_keys), :dim]))
            pooled = pool_sum(emb, layout)
            if self.mean_slots is not None:
                offsets = dev.tensor(np.asarray(layout.bag_offsets))
                pooled = pooled / bag_divisor(offsets, len(layout.inverse), len(mb), self.mean_slots)
            out.append(torch.sigmoid(model(self.model_input(pooled), dev.tensor(mb.dense))).cpu().numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)

    def resident_rows(self, keys: Any, columns: int) -> Any:
        """The first ``columns`` of the rows of ``keys`` (``uint64``, in the device's array
        module), every one among the keys :meth:`set_resident` noted: found by ``searchsorted``
        and gathered from the arena with torch ops (no table probe, no read-back)."""
        resident = self._resident
        assert resident is not None, "resident_rows before set_resident"
        res_keys, res_slots = resident
        k = torch.as_tensor(keys.view(self.device.xp.int64), device=self.device.torch)
        if k.numel() == 0 or res_keys.numel() == 0:
            return self.device.xp.zeros((k.numel(), columns), dtype=self.device.xp.float32)
        at = torch.searchsorted(res_keys, k).clamp_(max=res_keys.numel() - 1)
        rows = self.arena.rows(res_slots.index_select(0, at))
        return self.device.from_tensor(rows[:, :columns].contiguous())

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """The current rows of resident ``keys`` (``float32[n, width]``, on the host)."""
        return to_host(self.hbm.get(keys))

    def end_batch(
        self, batch_id: Any, key_parts: list[np.ndarray], keep: list[np.ndarray] | None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """At a batch's end, per owner, ``(keys, rows)`` of the keys that leave the working set
        (``keep[o]``: which of owner ``o``'s keys stay, :func:`~hpsray.training.working_set.keep_masks`;
        ``None``: none stay). The kept keys stay resident until the next batch's end or a :meth:`flush`."""
        self.kept = [k[m] for k, m in zip(key_parts, keep, strict=True)] if keep is not None else []
        leaving = key_parts if keep is None else [k[~m] for k, m in zip(key_parts, keep, strict=True)]
        out = [(k, self.rows(k)) for k in leaving]
        self.traffic.returned(batch_id, sum(k.size for k in leaving))
        return out

    def flush(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per owner, ``(keys, rows)`` of the rows kept at the last batch's end (empty when none
        were): their owners' copies are stale until these reach them. They stay resident."""
        kept, self.kept = self.kept, []
        self.traffic.flushed += sum(k.size for k in kept)
        return [(k, self.rows(k)) for k in kept]

    # -- the step ----------------------------------------------------------------------------

    def forward_backward(
        self, arena: ArenaStep, mb: MiniBatchIndex, total: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward and backward of one mini-batch: ``(gathered rows, loss, row gradients)``;
        the loss is this part's share of the mean over ``total`` examples."""
        gathered = arena.gather(mb.rows)
        loss, grads = self.backward_from(gathered, mb, total)
        return gathered, loss, grads

    def backward_from(self, rows: torch.Tensor, mb: MiniBatchIndex, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one mini-batch over ``rows`` (its distinct rows in the
        index's order, ``[U, >= dim]``): ``(loss, row gradients)``, the loss this part's share of
        the mean over ``total`` examples."""
        loss, pooled = self.backward_pooled(rows, mb, total)
        return loss, ArenaStep.row_grads(mb, pooled)

    def backward_pooled(self, rows: torch.Tensor, mb: MiniBatchIndex, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`backward_from` up to the pooled leaf: ``(loss, pooled)``, its gradient filled."""
        self.dense.zero_grad()
        pooled = ArenaStep.pool_rows(rows, mb, self.grad_dim)
        x = pooled
        if self.mean_slots is not None:
            x = pooled / bag_divisor(mb.bag_offsets, mb.inverse.shape[0], mb.n_examples, self.mean_slots)
        logits = self.dense.models[0](self.model_input(x), mb.dense)
        loss = F.binary_cross_entropy_with_logits(logits, mb.labels, reduction="sum") / total
        loss.backward()
        return loss.detach(), pooled

    def model_input(self, pooled: torch.Tensor) -> torch.Tensor:
        """The model's input from the pooled ``[B, n_slots, grad_dim]``: itself, or with the
        slots' widths differing each slot's first dim columns, ``[B, sum of the slots' dims]``."""
        if self.slot_cols is None:
            return pooled
        return pooled.reshape(pooled.shape[0], -1).index_select(1, self.slot_cols)

    def global_minibatches(self, index: BatchIndex, sizes: list[int]) -> Iterator[tuple[MiniBatchIndex | None, int]]:
        """This node's part of each global mini-batch of the batch (``None`` once its examples
        are used up) with the global mini-batch's size, for ``sizes`` (every node's examples)."""
        m = self.config.minibatch_size
        own = index.minibatches
        for k in range(max((-(-s // m) for s in sizes), default=0)):
            total = sum(min(max(s - k * m, 0), m) for s in sizes)
            yield (own[k] if k < len(own) else None), total

    def exchange_array(self, t: torch.Tensor, keys: bool = False) -> Any:
        """A tensor as the exchange takes it: numpy on the CPU (keys as uint64), CuPy on CUDA."""
        a = self.device.from_tensor(t)
        return a.view(self.device.xp.uint64) if keys else a

    def apply_updates(self, keys: Any, grads: Any) -> None:
        """Apply row gradients of any nodes (``uint64`` keys, ``float32`` grads: numpy, or CuPy on
        CUDA) to the rows held here at the current step; keys not held are skipped, duplicates
        summed in the order given (across nodes: rank order). Found by ``searchsorted`` in the
        batch's sorted keys: one probe per call, no table probe."""
        if self._resident is None or keys.shape[0] == 0:
            return
        dev = self.device.torch
        res_keys, res_slots = self._resident
        k = torch.as_tensor(keys.view(self.device.xp.int64), device=dev)
        g = torch.as_tensor(grads, device=dev)
        if res_keys.numel() == 0:
            return
        at = torch.searchsorted(res_keys, k).clamp_(max=res_keys.numel() - 1)
        held = res_keys.index_select(0, at) == k
        slots = res_slots.index_select(0, at)[held]
        g = g[held]
        distinct, inverse = torch.unique(slots, return_inverse=True)
        summed = torch.zeros((distinct.numel(), g.shape[1]), dtype=g.dtype, device=dev).index_add_(0, inverse, g)
        arena = self.arena
        arena.update(distinct, arena.gather(distinct), summed, self.step)
