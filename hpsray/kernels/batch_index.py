"""The batch's index on the CPU in two passes over its occurrences (numba), no sort.

:func:`index_slots` computes what :func:`hpsray.training.layout.index_batch` computes with a
stable torch sort over ``(mini-batch, slot)`` — and equal to it element for element (its torch
ops are this kernel's twin, and the path every other device takes): per mini-batch, a count of
each slot and a bitmap of the slots present give the distinct rows in ascending slot order
(a scan of the bitmap's set bits: ``capacity / 64`` words, not a sort), each row's start among
the gradient's bags; a second pass in occurrence order places every occurrence's bag after the
ones before it (stable, so a row sums its occurrences in bag order). ``O(nnz + capacity / 64)``
per mini-batch where the sort is ``O(nnz log nnz)``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

__all__ = ["MAX_LANES", "SCRATCH_ROWS_PER_OCCURRENCE", "in_bag_order", "index_slots", "pays"]

MAX_LANES = 4  # mini-batches indexed at once: each holds 8 bytes of scratch per working-set row
SCRATCH_ROWS_PER_OCCURRENCE = 16  # beyond this working set per occurrence the sort is cheaper

_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
# _CTZ[(lowbit * _DEBRUIJN) >> 58] is the index of lowbit's one set bit
_CTZ = np.zeros(64, np.int64)
for _i in range(64):
    _CTZ[int(((1 << _i) * int(_DEBRUIJN)) % 2**64) >> 58] = _i


@njit(cache=True)
def in_bag_order(example_offsets, bag_slots):
    """Whether a batch's occurrences are in bag order: each example's slots ascending (its
    examples are in order by construction)."""
    for e in range(example_offsets.size - 1):
        for i in range(example_offsets[e] + 1, example_offsets[e + 1]):
            if bag_slots[i] < bag_slots[i - 1]:
                return False
    return True


@njit(cache=True, nogil=True)
def _minibatch(
    k, slots, example_offsets, bag_slots, n_slots, m, ctz, bits, state, rows, inverse, grad_bags, grad_offsets, first,
    bag_start,
):  # fmt: skip
    """Index mini-batch ``k``; its rows go to ``rows[lo:]`` (``lo``: its first occurrence;
    ``grad_offsets`` and ``first`` alike). Returns its rows' count, ``-1`` for a slot outside
    ``[0, capacity)``. ``state[s]``: slot ``s``'s count, then its row's index within the
    mini-batch (column 0), and its first occurrence, then its next place (column 1); ``bits``
    and column 0 are zero before and after."""
    n = example_offsets.size - 1
    e0, e1 = k * m, min((k + 1) * m, n)
    lo, hi = example_offsets[e0], example_offsets[e1]
    w_lo, w_hi = bits.size, 0
    for i in range(lo, hi):  # pass 1: count each slot, mark it present
        s = slots[i]
        if s < 0 or s >= state.shape[0]:
            return -1  # the caller raises, and stops using this scratch
        if state[s, 0] == 0:
            state[s, 1] = i
            w = s >> 6
            bits[w] |= np.uint64(1) << np.uint64(s & 63)
            w_lo, w_hi = min(w_lo, w), max(w_hi, w + 1)
        state[s, 0] += 1
    u, at = 0, 0
    for w in range(w_lo, w_hi):  # the slots present, ascending: each a row of the mini-batch
        x = bits[w]
        bits[w] = 0
        while x:
            low = x & (~x + np.uint64(1))
            s = w * 64 + ctz[(low * _DEBRUIJN) >> np.uint64(58)]
            rows[lo + u] = s
            grad_offsets[lo + u] = at
            first[lo + u] = state[s, 1]
            state[s, 1] = at
            at += state[s, 0]
            state[s, 0] = u
            u += 1
            x ^= low
    for e in range(e0, e1):  # pass 2, occurrence order: each occurrence after the earlier ones
        bag0 = (e - e0) * n_slots
        i, end = example_offsets[e], example_offsets[e + 1]
        for b in range(n_slots):  # each bag starts at its example's first occurrence of slot >= b
            while i < end and bag_slots[i] < b:
                i += 1
            bag_start[e * n_slots + b] = i - lo
        for i in range(example_offsets[e], end):
            s = slots[i]
            inverse[i] = state[s, 0]
            p = state[s, 1]
            grad_bags[lo + p] = bag0 + bag_slots[i]
            state[s, 1] = p + 1
    for g in range(u):
        state[rows[lo + g], 0] = 0
    return u


@njit(cache=True, parallel=True)
def _index(
    slots, example_offsets, bag_slots, n_slots, m, ctz, bits, state, rows, inverse, grad_bags, grad_offsets, first,
    counts, bag_start,
):  # fmt: skip
    """Every mini-batch, ``len(bits)`` at a time (each with its scratch ``bits[t]``,
    ``state[t]``): ``counts[k]`` is mini-batch ``k``'s rows (``-1``: a slot out of range)."""
    n_mb = counts.size
    lanes = bits.shape[0]
    for t in prange(lanes):
        for k in range(t, n_mb, lanes):
            counts[k] = _minibatch(
                k, slots, example_offsets, bag_slots, n_slots, m, ctz, bits[t], state[t], rows, inverse, grad_bags,
                grad_offsets, first, bag_start,
            )  # fmt: skip
            if counts[k] < 0:
                break  # its scratch is not zero now: no later mini-batch of this lane may use it


def pays(nnz: int, capacity: int) -> bool:
    """Whether the kernel beats the sort for ``nnz`` occurrences in a working set of
    ``capacity`` rows: its scratch (8 bytes a row, zeroed per batch) stays within a small
    multiple of the occurrences."""
    return capacity <= SCRATCH_ROWS_PER_OCCURRENCE * nnz + 2**16


def index_slots(
    slots: np.ndarray, example_offsets: np.ndarray, bag_slots: np.ndarray, n_slots: int, m: int, capacity: int
) -> dict[str, np.ndarray]:
    """The index of a batch whose ``nnz`` occurrences (``example_offsets``: each example's,
    ``bag_slots``: each one's feature slot) read the working-set rows ``slots`` (``int64``, each
    in ``[0, capacity)``), in mini-batches of ``m`` examples. The occurrences must be in bag
    order (:func:`in_bag_order`: the caller checks, and sorts them where they are not).

    Returns ``rows`` (``int64``: each mini-batch's distinct slots, ascending, one mini-batch
    after the other), ``bounds`` (mini-batch ``k``'s rows are ``bounds[k]:bounds[k + 1]``),
    per occurrence ``inverse`` (its row's index within its mini-batch), ``grad_bags`` (per
    mini-batch, the occurrences' bags within it grouped by row, in bag order), per row
    ``grad_offsets`` (its first place in ``grad_bags`` within the mini-batch) and ``first`` (its
    first occurrence), and ``bag_start`` (each bag's first occurrence within its mini-batch).
    A slot outside ``[0, capacity)`` raises :class:`ValueError`."""
    nnz, n = int(slots.size), int(example_offsets.size - 1)
    n_mb = max(-(-n // m), 0)
    rows = np.empty(nnz, np.int64)
    grad_offsets = np.empty(nnz, np.int32)
    first = np.empty(nnz, np.int64)
    counts = np.empty(n_mb, np.int64)
    out: dict[str, np.ndarray] = {
        "inverse": np.empty(nnz, np.int32),
        "grad_bags": np.empty(nnz, np.int32),
        "bag_start": np.empty(n * n_slots, np.int32),
    }
    lanes = max(min(numba.get_num_threads(), n_mb, MAX_LANES), 1)
    _index(
        np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(example_offsets, np.int64),
        np.ascontiguousarray(bag_slots, np.int32), n_slots, m, _CTZ, np.zeros((lanes, -(-capacity // 64)), np.uint64),
        np.zeros((lanes, capacity, 2), np.int32), rows, out["inverse"], out["grad_bags"], grad_offsets, first, counts,
        out["bag_start"],
    )  # fmt: skip
    if (counts < 0).any():
        raise ValueError(f"a slot outside [0, {capacity}) in the batch's index")
    starts = np.asarray(example_offsets)[np.arange(n_mb) * m]
    parts = [slice(int(a), int(a + c)) for a, c in zip(starts, counts, strict=True)]
    out["bounds"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for name, arr in (("rows", rows), ("grad_offsets", grad_offsets), ("first", first)):
        out[name] = np.concatenate([arr[p] for p in parts]) if parts else arr[:0]
    return out
