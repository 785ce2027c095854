"""Row kernels: initialise, gather, scatter and optimizer-apply rows of the arena.

Row copies put consecutive threads on consecutive columns of a row (coalesced). Updates come in
two forms: ``*_direct`` when a call holds every slot once (one thread per element, or per row for
the optimizer), and ``*_segments`` over the groups of equal slots that
:mod:`hpsray.kernels.cuda.scans` builds, walked in input order so that sums, last-wins and float
rounding equal the CPU backend's.
"""

from __future__ import annotations

from hpsray.kernels.cuda.common import cuda
from hpsray.kernels.init import init_row
from hpsray.kernels.optim import apply_row_update


@cuda.jit
def k_init_rows(rows, row_keys, slots, dim, scale, seed, state_value):
    t = cuda.grid(1)
    if t < slots.size:
        s = slots[t]
        init_row(rows[s], row_keys[s], dim, rows.shape[1], scale, seed, state_value)


@cuda.jit
def k_check_slots(slots, capacity, stat):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s < 0 or s >= capacity:
            stat[0] = 1


@cuda.jit
def k_gather(rows, slots, out):
    """One thread per element; consecutive threads read consecutive columns of a row."""
    t = cuda.grid(1)
    width = out.shape[1]
    if t < slots.size * width:
        i = t // width
        j = t - i * width
        out[i, j] = rows[slots[i], j]


@cuda.jit
def k_gather_keys(row_keys, slots, out):
    i = cuda.grid(1)
    if i < slots.size:
        out[i] = row_keys[slots[i]]


@cuda.jit
def k_scatter_direct(rows, slots, values, add):
    """No duplicates: one thread per element."""
    t = cuda.grid(1)
    width = values.shape[1]
    if t < slots.size * width:
        i = t // width
        j = t - i * width
        if add:
            rows[slots[i], j] += values[i, j]
        else:
            rows[slots[i], j] = values[i, j]


@cuda.jit
def k_scatter_segments(rows, slots, values, order, starts, add):
    """One thread per (distinct row, column), walking its duplicates in input order."""
    t = cuda.grid(1)
    width = values.shape[1]
    n_seg = starts.size - 1
    if t < n_seg * width:
        r = t // width
        j = t - r * width
        a = starts[r]
        e = starts[r + 1]
        s = slots[order[a]]
        if add:
            v = rows[s, j]
            for p in range(a, e):
                v += values[order[p], j]
            rows[s, j] = v
        else:
            rows[s, j] = values[order[e - 1], j]


@cuda.jit
def k_apply_direct(rows, slots, grads, kind, hp):
    i = cuda.grid(1)
    if i < slots.size:
        apply_row_update(kind, rows[slots[i]], grads[i], grads.shape[1], hp)


@cuda.jit
def k_sum_segments(grads, order, starts, acc):
    """``acc[r]`` = the gradients of segment ``r`` summed in input order (as the CPU does)."""
    t = cuda.grid(1)
    dim = grads.shape[1]
    n_seg = starts.size - 1
    if t < n_seg * dim:
        r = t // dim
        j = t - r * dim
        a = starts[r]
        v = grads[order[a], j]
        for p in range(a + 1, starts[r + 1]):
            v += grads[order[p], j]
        acc[r, j] = v


@cuda.jit
def k_apply_segments(rows, slots, order, starts, acc, kind, hp):
    r = cuda.grid(1)
    if r < acc.shape[0]:
        apply_row_update(kind, rows[slots[order[starts[r]]]], acc[r], acc.shape[1], hp)
