"""Find once per batch: every key occurrence of a batch resolved to its working-set slot.

:func:`index_batch` runs once when a batch's rows are resident (docs/architecture.md: The
mini-batch step). It asks the HBM-PS table for the slot of every key occurrence in one
``find``, then with a handful of torch ops on the step's device (one stable sort over
``(mini-batch, slot)``: :func:`index_batch_sorted`) lays out every mini-batch of the batch: its
distinct rows, where each occurrence reads its row from, the pooling bags, and the order in
which a row's gradient sums its bags. On the CPU a numba kernel computes the same arrays in two
passes over the occurrences, without the sort (:mod:`hpsray.kernels.batch_index`). A
mini-batch step is then slices of these arrays: no hash probe, no dedupe, no host work and no
read-back. On CUDA the only host reads are the mini-batch bounds, once per batch.

Orders (what makes the step bit-equal to the reference on the CPU): a bag sums its keys in
batch order (keys sorted by bag, stable, as :class:`~hpsray.models.pooling.BagLayout` does);
a row's gradient sums the gradients of its occurrences in that same order, starting from zero
(as :func:`~hpsray.models.pooling._bag_grad` does): the stable sort keeps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.kernels.batch_index import in_bag_order, index_slots, pays
from hpsray.tiers.partition import owner_of

__all__ = [
    "BatchIndex",
    "MiniBatchIndex",
    "Staged",
    "index_batch",
    "index_batch_sorted",
    "index_positions",
    "keys_as_tensor",
    "positions_of",
]


# a mini-batch's inverse, bag_offsets, grad_bags, grad_offsets, dense and labels
_Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class MiniBatchIndex:
    """One mini-batch as views of its batch's :class:`BatchIndex` (all on the step's device).

    ``rows[inverse[i]]`` is the arena slot of occurrence ``i`` (occurrences in bag order);
    ``bag_offsets`` start each of the ``n_examples * n_slots`` bags in that order;
    ``grad_bags[grad_offsets[u]:grad_offsets[u + 1]]`` are the bags of row ``u``'s occurrences,
    in bag order (``F.embedding_bag`` over the pooled gradient sums them: row ``u``'s gradient).
    ``keys``: the rows' keys (``int64`` bit patterns of the ``uint64`` keys)."""

    rows: torch.Tensor  # int64[U]
    keys: torch.Tensor | None  # int64[U] (when the index was made with them)
    inverse: torch.Tensor  # int32[nnz]
    bag_offsets: torch.Tensor  # int32[n_examples * n_slots]
    grad_bags: torch.Tensor  # int32[nnz]
    grad_offsets: torch.Tensor  # int32[U]
    dense: torch.Tensor  # float32[n_examples, n_dense]
    labels: torch.Tensor  # float32[n_examples]
    n_examples: int
    n_slots: int


@dataclass(frozen=True)
class BatchIndex:
    """A batch resolved against the working set (see the module docstring); ``minibatches``
    in order, each of ``minibatch_size`` examples but the last; ``bounds[k]:bounds[k + 1]``
    are mini-batch ``k``'s rows in ``rows``."""

    minibatches: list[MiniBatchIndex]
    rows: torch.Tensor  # int64[R]: every mini-batch's distinct rows, one after the other
    n_examples: int
    bounds: tuple[int, ...] = ()
    staging: Staged | None = None  # the host arrays put together for an upload (:meth:`staged`)

    def __len__(self) -> int:
        return len(self.minibatches)

    def staged(self, device: torch.device) -> BatchIndex:
        """This index (over positions: :func:`index_positions`) with its host arrays put
        together for ``device`` (:class:`Staged`, pinned on a CUDA device), so that
        :meth:`at_slots` there is two asynchronous copies and no host work: the trainer stages a
        batch on the thread that fetches it ahead while the batch before trains. On the CPU (no
        upload to make): this index."""
        if device.type == "cpu" or self.staging is not None:
            return self
        return dataclasses.replace(self, staging=self._stage(device))

    def at_slots(
        self, slots: torch.Tensor, keys: torch.Tensor | None, device: torch.device, pack: bool | None = None
    ) -> BatchIndex:
        """This index, made over positions (:func:`index_positions`), with each position's row
        at ``slots[position]`` (``int64`` on ``device``), on ``device``; ``keys`` (the positions'
        ``int64`` key bits, on ``device``): each mini-batch's rows' keys too. One gather per
        batch; the layout's orders are kept (a row's place within a mini-batch changes nothing
        the step sums: each bag and each row sums its own occurrences in bag order).

        ``pack`` (default: off the CPU, or when :meth:`staged`) moves the layout as the two
        buffers of :class:`Staged` instead of a copy per array (25 for 4 mini-batches); the
        mini-batches are views of them on the device."""
        if pack is None:
            pack = device.type != "cpu" or self.staging is not None
        pos, arrays = self._packed(device) if pack else self._copied(device)
        rows = slots.index_select(0, pos)
        row_keys = keys.index_select(0, pos) if keys is not None else None
        b = self.bounds
        out = [
            MiniBatchIndex(
                rows=rows[b[k] : b[k + 1]],
                keys=row_keys[b[k] : b[k + 1]] if row_keys is not None else None,
                inverse=inverse,
                bag_offsets=bag_offsets,
                grad_bags=grad_bags,
                grad_offsets=grad_offsets,
                dense=dense,
                labels=labels,
                n_examples=mb.n_examples,
                n_slots=mb.n_slots,
            )
            for k, (mb, (inverse, bag_offsets, grad_bags, grad_offsets, dense, labels)) in enumerate(
                zip(self.minibatches, arrays, strict=True)
            )
        ]
        return BatchIndex(out, rows, self.n_examples, b)

    def _copied(self, device: torch.device) -> tuple[torch.Tensor, list[_Arrays]]:
        """The positions and each mini-batch's six arrays on ``device``, a copy per array."""
        arrays = [
            (
                mb.inverse.to(device),
                mb.bag_offsets.to(device),
                mb.grad_bags.to(device),
                mb.grad_offsets.to(device),
                mb.dense.to(device),
                mb.labels.to(device),
            )
            for mb in self.minibatches
        ]
        return self.rows.to(device), arrays

    def _stage(self, device: torch.device) -> Staged:
        """The host arrays in the two buffers of :class:`Staged` for ``device`` (in pinned memory
        where it is a CUDA device)."""
        pinned = device.type == "cuda" and torch.cuda.is_available()
        if self.rows.numel() >= 2**31:
            raise ValueError(f"a batch of {self.rows.numel()} positions does not fit int32")
        ints = [self.rows.to(torch.int32)]
        floats = []
        for mb in self.minibatches:
            ints += [mb.inverse, mb.bag_offsets, mb.grad_bags, mb.grad_offsets]
            floats += [mb.dense.reshape(-1), mb.labels]
        return Staged(*_together(ints, torch.int32, pinned), *_together(floats, torch.float32, pinned), pinned)

    def _packed(self, device: torch.device) -> tuple[torch.Tensor, list[_Arrays]]:
        """:meth:`_copied` through the two buffers of :class:`Staged` (:meth:`staged`, else
        staged now): views of them on ``device``."""
        st = self.staging or self._stage(device)
        cut = iter(_views(st.ints.to(device, non_blocking=st.pinned), st.int_spans))
        fcut = iter(_views(st.floats.to(device, non_blocking=st.pinned), st.float_spans))
        pos = next(cut)
        arrays = [
            (next(cut), next(cut), next(cut), next(cut), next(fcut).view(mb.dense.shape), next(fcut))
            for mb in self.minibatches
        ]
        return pos, arrays


ALIGN = 16
"""Each array in a :class:`Staged` buffer starts at a multiple of this many elements (64 bytes:
the device's vector loads see aligned arrays, as with arrays of their own)."""


@dataclass(frozen=True)
class Staged:
    """A :class:`BatchIndex`'s host arrays in two buffers, each array at ``ALIGN`` elements:
    ``ints`` every ``int32`` array (the positions, then each mini-batch's ``inverse``,
    ``bag_offsets``, ``grad_bags``, ``grad_offsets``), ``floats`` each mini-batch's dense
    features (flat) and labels; ``*_spans``: each array's ``(start, length)`` in its buffer;
    ``pinned``: in pinned host memory (so the copies to the device are asynchronous)."""

    ints: torch.Tensor
    int_spans: tuple[tuple[int, int], ...]
    floats: torch.Tensor
    float_spans: tuple[tuple[int, int], ...]
    pinned: bool


def _together(
    parts: list[torch.Tensor], dtype: torch.dtype, pinned: bool
) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """``parts`` (host tensors of ``dtype``) copied into one buffer, each at a multiple of
    :data:`ALIGN` elements (in pinned memory where ``pinned``), and their spans in it."""
    sizes = [t.numel() for t in parts]
    starts = np.concatenate([[0], np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes])])
    buf = torch.empty(int(starts[-1]), dtype=dtype, pin_memory=pinned)
    spans = tuple((int(a), n) for a, n in zip(starts[:-1], sizes, strict=True))
    for (a, n), t in zip(spans, parts, strict=True):
        buf[a : a + n].copy_(t.reshape(-1))
    return buf, spans


def _views(buf: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
    """``buf`` cut at ``spans`` (views)."""
    return [buf.narrow(0, a, n) for a, n in spans]


def index_positions(batch: Batch, minibatch_size: int, positions: np.ndarray, n_positions: int) -> BatchIndex:
    """The layout of ``batch`` over positions instead of slots, on the CPU, where the keys are
    (the read stage): ``positions[i]`` (``< n_positions``) names key occurrence ``i``'s row,
    the key's position in the batch's distinct keys as the trainer borrows them (split by
    owner, in owner order: :func:`positions_of`). :meth:`BatchIndex.at_slots` then gives the
    trainer's index with one probe of the distinct keys and one gather, instead of a probe of
    every occurrence and the sort."""
    order = _bag_order(batch)
    pos = torch.from_numpy(np.ascontiguousarray(positions if order is None else positions[order], dtype=np.int64))
    return index_batch(batch, minibatch_size, lambda keys, on: pos, n_positions, torch.device("cpu"), False)


def positions_of(keys: np.ndarray, n_owners: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``(parts, positions)`` of a batch's ``keys``: ``parts[o]`` the distinct keys node ``o``
    owns (:func:`~hpsray.tiers.partition.owner_of`), sorted, and each occurrence's position in
    those parts put together: one sort of the occurrences gives both."""
    order = np.argsort(keys)
    ordered = keys[order]
    new = np.empty(ordered.size, dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    distinct = ordered[new]
    rank = np.empty(keys.size, dtype=np.int64)
    rank[order] = np.cumsum(new) - 1  # each occurrence's rank among the distinct keys
    if n_owners == 1:
        return [distinct], rank
    owners = owner_of(distinct, n_owners)
    by_owner = np.argsort(owners, kind="stable")
    place = np.empty(distinct.size, dtype=np.int64)
    place[by_owner] = np.arange(distinct.size)
    parts = np.split(distinct[by_owner], np.cumsum(np.bincount(owners, minlength=n_owners))[:-1])
    return parts, place[rank]


def _bag_order(batch: Batch) -> np.ndarray | None:
    """The stable order that puts ``batch``'s keys in bag order (``None``: they are already)."""
    bag = batch.example_of_key() * batch.n_slots + batch.slots
    if batch.nnz > 1 and np.any(bag[1:] < bag[:-1]):
        return np.argsort(bag, kind="stable")
    return None


def keys_as_tensor(keys: np.ndarray, device: torch.device) -> torch.Tensor:
    """``uint64`` keys as an ``int64`` tensor of the same bits on ``device`` (torch sorts and
    compares int64; the order differs from uint64's, which no caller relies on)."""
    bits = np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)
    if not bits.flags.writeable:  # an object-store array: torch wants a writable one
        bits = bits.copy()
    return torch.from_numpy(bits).to(device)


def index_batch(
    batch: Batch,
    minibatch_size: int,
    find: Callable[[np.ndarray, torch.Tensor | None], torch.Tensor],
    capacity: int,
    device: torch.device,
    with_keys: bool = True,
) -> BatchIndex:
    """Resolve ``batch`` against the working set.

    ``find(keys, keys_on_device)`` returns the arena slot (``int64``, on ``device``) of every
    key, given as ``uint64`` numpy and as an ``int64`` tensor on ``device`` where one was made
    (off the CPU, or ``with_keys``; else ``None``); every key must be resident (the caller
    checks). ``capacity`` bounds the slots. ``with_keys``: also give each mini-batch's rows'
    keys (for an exchange across nodes; one gather more)."""
    if minibatch_size <= 0:
        raise ValueError(f"mini-batch size must be positive, got {minibatch_size}")
    # a mini-batch's positions are int32 (half the index's memory and traffic)
    if batch.nnz and int(np.max(np.diff(np.append(batch.offsets[::minibatch_size], batch.nnz)))) >= 2**31:
        raise ValueError(f"a mini-batch of {minibatch_size} examples holds 2**31 keys or more")
    if device.type == "cpu" and pays(batch.nnz, capacity) and in_bag_order(batch.offsets, batch.slots):
        return _index_on_cpu(batch, minibatch_size, find, capacity, with_keys)
    return index_batch_sorted(batch, minibatch_size, find, capacity, device, with_keys)


def index_batch_sorted(
    batch: Batch,
    minibatch_size: int,
    find: Callable[[np.ndarray, torch.Tensor | None], torch.Tensor],
    capacity: int,
    device: torch.device,
    with_keys: bool = True,
) -> BatchIndex:
    """:func:`index_batch` by torch ops on ``device`` around one stable sort (the path off the
    CPU, for batches out of bag order, and the CPU kernel's twin)."""
    n, n_slots, nnz = len(batch), batch.n_slots, batch.nnz
    m = minibatch_size
    # every array over the occurrences is made on the device from the offsets and slots: on
    # the host only the order check (one pass) and, for a batch out of bag order, its sort
    keys, order = batch.keys, None if in_bag_order(batch.offsets, batch.slots) else _bag_order(batch)
    offsets = torch.from_numpy(np.ascontiguousarray(batch.offsets, dtype=np.int64)).to(device)
    example = torch.repeat_interleave(torch.arange(n, device=device), torch.diff(offsets), output_size=nnz)
    bag = example * n_slots + torch.from_numpy(np.ascontiguousarray(batch.slots, dtype=np.int32)).to(device)
    if order is not None:  # keys of an example not in slot order: sorted by bag, stably
        keys, to_order = keys[order], torch.from_numpy(order).to(device)
        bag, example = bag.index_select(0, to_order), example.index_select(0, to_order)
    on = keys_as_tensor(keys, device) if with_keys or device.type != "cpu" else None
    slots = find(keys, on)
    n_mb = -(-n // m)
    # one stable sort by (mini-batch, slot); int32 when the composite fits (half the work)
    narrow = n_mb * (capacity + 1) < 2**31
    mb_of = torch.div(example, m, rounding_mode="floor")
    composite = slots.to(torch.int32 if narrow else torch.int64).add_(
        mb_of.to(torch.int32 if narrow else torch.int64) * (capacity + 1)
    )
    sorted_c, perm = torch.sort(composite, stable=True)
    new = torch.ones(nnz, dtype=torch.bool, device=device)
    if nnz > 1:
        torch.ne(sorted_c[1:], sorted_c[:-1], out=new[1:])
    starts = torch.nonzero(new).squeeze(1)  # sorted position of each group's first occurrence
    group = torch.cumsum(new, 0, dtype=torch.int64)  # 1 + each sorted position's group (a distinct row)
    ex_bounds = np.minimum(np.arange(n_mb + 1, dtype=np.int64) * m, n)
    occ = batch.offsets[ex_bounds]  # each mini-batch's occurrences: [occ[k], occ[k + 1])
    occ_t = torch.from_numpy(np.ascontiguousarray(occ, dtype=np.int64)).to(device)
    first_group = torch.searchsorted(starts, occ_t)  # each mini-batch's groups: [g[k], g[k + 1])
    g = first_group.tolist()  # the batch's one read-back on CUDA
    per_mb = torch.diff(occ_t)  # sorted by mini-batch first: runs of each
    before_mb = torch.repeat_interleave(first_group[:-1] + 1, per_mb, output_size=nnz)
    group.sub_(before_mb)  # now the group within its mini-batch
    inverse = torch.empty(nnz, dtype=torch.int32, device=device).index_copy_(0, perm, group.to(torch.int32))
    grad_bags = (bag - mb_of * (m * n_slots)).to(torch.int32).index_select(0, perm)  # bags within the mini-batch
    groups_per_mb = torch.diff(first_group)
    grad_offsets = (starts - torch.repeat_interleave(occ_t[:-1], groups_per_mb, output_size=starts.numel())).int()
    mb_of_group = torch.repeat_interleave(
        torch.arange(n_mb, dtype=sorted_c.dtype, device=device), groups_per_mb, output_size=starts.numel()
    )
    rows = (sorted_c.index_select(0, starts) - mb_of_group * (capacity + 1)).long()  # sorted within a mini-batch
    row_keys = on.index_select(0, perm.index_select(0, starts)) if on is not None and with_keys else None
    # each bag's first occurrence (the occurrences are in bag order), from its mini-batch's first
    all_bags = torch.arange(n * n_slots, device=device)
    bag_start = torch.searchsorted(bag, all_bags) - occ_t.index_select(0, all_bags // (m * n_slots))
    bag_offsets = bag_start.to(torch.int32)
    return _cut(batch, m, g, rows, row_keys, (inverse, bag_offsets, grad_bags, grad_offsets), device)


def _cut(
    batch: Batch,
    m: int,
    g: list[int],
    rows: torch.Tensor,
    row_keys: torch.Tensor | None,
    arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    device: torch.device,
) -> BatchIndex:
    """The batch's index cut into mini-batches of ``m`` examples: mini-batch ``k``'s rows
    (and keys, and gradient offsets) are ``g[k]:g[k + 1]``; ``arrays``: the batch's ``inverse``,
    ``bag_offsets``, ``grad_bags`` and ``grad_offsets``."""
    inverse, bag_offsets, grad_bags, grad_offsets = arrays
    n, n_slots, occ = len(batch), batch.n_slots, batch.offsets
    dense, labels = _tensor(batch.dense, device), _tensor(batch.labels, device)
    out = []
    for k in range(len(g) - 1):
        e0, e1 = k * m, min((k + 1) * m, n)
        lo, hi = int(occ[e0]), int(occ[e1])
        out.append(
            MiniBatchIndex(
                rows=rows[g[k] : g[k + 1]],
                keys=row_keys[g[k] : g[k + 1]] if row_keys is not None else None,
                inverse=inverse[lo:hi],
                bag_offsets=bag_offsets[e0 * n_slots : e1 * n_slots],
                grad_bags=grad_bags[lo:hi],
                grad_offsets=grad_offsets[g[k] : g[k + 1]],
                dense=dense[e0:e1],
                labels=labels[e0:e1],
                n_examples=e1 - e0,
                n_slots=n_slots,
            )
        )
    return BatchIndex(out, rows, n, tuple(g))


def _index_on_cpu(
    batch: Batch,
    m: int,
    find: Callable[[np.ndarray, torch.Tensor | None], torch.Tensor],
    capacity: int,
    with_keys: bool,
) -> BatchIndex:
    """:func:`index_batch` on the CPU for a batch in bag order: the same index from two passes
    over the occurrences (:func:`~hpsray.kernels.batch_index.index_slots`) instead of the sort."""
    on = keys_as_tensor(batch.keys, torch.device("cpu")) if with_keys else None
    slots = find(batch.keys, on)
    ix = index_slots(slots.numpy(), batch.offsets, batch.slots, batch.n_slots, m, capacity)  # in bag order: checked
    rows = torch.from_numpy(ix["rows"])
    row_keys = on.index_select(0, torch.from_numpy(ix["first"])) if on is not None else None
    inverse, grad_bags = torch.from_numpy(ix["inverse"]), torch.from_numpy(ix["grad_bags"])
    arrays = (inverse, torch.from_numpy(ix["bag_start"]), grad_bags, torch.from_numpy(ix["grad_offsets"]))
    return _cut(batch, m, ix["bounds"].tolist(), rows, row_keys, arrays, torch.device("cpu"))


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A float32 array as a tensor on ``device``; a read-only one (from the object store) is
    copied first, since torch tensors are writable."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return torch.from_numpy(a if a.flags.writeable else a.copy()).to(device)
