"""SSD-PS read planning, the numba kernels of :mod:`hpsray.tiers.ssd.reads`: found keys grouped
by file and chunk (:func:`group_keys`), the touched checksummed blocks of many files merged into
read ranges (:func:`plan_blocks`), and the rows picked out of a staged file (:func:`pick_rows`).
No Python per key, row or block.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

from hpsray.tiers.ssd.paramfile import HEADER_BYTES

__all__ = ["group_keys", "pick_rows", "plan_blocks"]


@njit(cache=True, parallel=True)
def _group(fs, ps, n_file_slots, chunk_rows, n_chunks, n_threads):
    """Group the found keys by file, and within a file by chunk of ``chunk_rows`` rows (a
    counting sort, both passes split among the threads). ``fs``, ``ps``: each key's file slot
    (-1: absent) and row position. Returns ``(idx, pos, starts)``: the keys of file slot ``f``
    are ``idx[starts[f]:starts[f+1]]`` (positions into ``fs``; in a file, ascending by chunk,
    then by position into ``fs``), at row positions ``pos[...]`` of that file."""
    n_all = fs.size
    n_t = max(1, min(n_threads, n_all // 65536))
    n_b = n_file_slots * n_chunks
    counts = np.zeros((n_t, n_b), dtype=np.int64)
    bk = np.empty(n_all, dtype=np.int32)
    for t in numba.prange(n_t):
        for i in range(t * n_all // n_t, (t + 1) * n_all // n_t):
            f = fs[i]
            if f >= 0:
                b = f * n_chunks + min(max(ps[i] // chunk_rows, 0), n_chunks - 1)
                bk[i] = b
                counts[t, b] += 1
            else:
                bk[i] = -1
    starts = np.empty(n_file_slots + 1, dtype=np.int64)
    at = 0
    for b in range(n_b):  # counts become each thread's first place in each bucket
        if b % n_chunks == 0:
            starts[b // n_chunks] = at
        for t in range(n_t):
            c = counts[t, b]
            counts[t, b] = at
            at += c
    starts[n_file_slots] = at
    idx = np.empty(at, dtype=np.int64)
    pos = np.empty(at, dtype=np.int64)
    for t in numba.prange(n_t):
        for i in range(t * n_all // n_t, (t + 1) * n_all // n_t):
            b = bk[i]
            if b >= 0:
                c = counts[t, b]
                idx[c] = i
                pos[c] = ps[i]
                counts[t, b] = c + 1
    return idx, pos, starts


def group_keys(
    fs: np.ndarray, ps: np.ndarray, n_file_slots: int, chunk_rows: int, n_chunks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_group`; a batch with fewer keys than buckets (a few keys, a store of many files)
    is grouped by a stable sort instead, the same result without a count per bucket."""
    if 4 * fs.size >= n_file_slots * n_chunks:
        return _group(fs, ps, n_file_slots, chunk_rows, n_chunks, numba.get_num_threads())
    at = np.flatnonzero(fs >= 0)
    f = fs[at].astype(np.int64)
    bucket = f * n_chunks + np.clip(ps[at] // chunk_rows, 0, n_chunks - 1)
    order = np.argsort(bucket, kind="stable")
    starts = np.zeros(n_file_slots + 1, dtype=np.int64)
    np.cumsum(np.bincount(f, minlength=n_file_slots), out=starts[1:])
    return at[order].astype(np.int64), ps[at][order].astype(np.int64), starts


@njit(cache=True, nogil=True)
def pick_rows(out, idx, rows, pos, file_keys, keys):
    """``out[idx[j]] = rows[pos[j]]``, checking that the file holds the key there; returns -1,
    or the first ``j`` whose key does not match."""
    width = rows.shape[1]
    for j in range(idx.size):
        p = pos[j]
        i = idx[j]
        if p >= rows.shape[0] or file_keys[p] != keys[i]:
            return j
        for c in range(width):
            out[i, c] = rows[p, c]
    return -1


@njit(cache=True, inline="always")
def _close_run(ranges, nr, fd, base, first_row, rows, unit, at, kind):
    """Range ``nr``: ``rows`` of ``unit`` bytes from row ``first_row`` of the section at ``base``,
    staged at row ``at`` of the buffer of ``kind``; returns ``nr + 1``."""
    ranges[nr, 0] = fd
    ranges[nr, 1] = base + unit * first_row
    ranges[nr, 2] = unit * rows
    ranges[nr, 3] = kind
    ranges[nr, 4] = unit * at
    return nr + 1


@njit(cache=True)
def plan_blocks(ustart, ublock, nrows, tfd, block_rows, row_bytes, max_gap, with_keys=True):
    """The blocks and ranges of a partial round. Task ``t`` (a file: descriptor ``tfd[t]``,
    ``nrows[t]`` rows) wants the distinct blocks ``ublock[ustart[t]:ustart[t+1]]`` (ascending);
    those inside its file become block ``v`` = number ``blk_b[v]`` of ``blk_n[v]`` rows, and
    ``umap[u]`` is ``v`` (-1 for a block outside the file). The keys of blocks less than
    ``max_gap`` bytes apart are read as one range (the keys between them too), and so are their
    rows: one range per run (``ranges``: descriptor, file offset, length, kind 0 for keys (8
    bytes a row) or 1 for rows (``row_bytes``), staging byte in that kind's buffer); block
    ``v``'s first key is staged key ``blk_kat[v]``, its first row staged row ``blk_at[v]``.
    ``with_keys=False`` plans no key ranges (one-row blocks, whose keys the caller knows: the
    key it asked for is the one the checksum covers). Returns the arrays, then the numbers of
    staged keys and staged rows."""
    m = ublock.size
    blk_task = np.empty(m, np.int64)
    blk_b = np.empty(m, np.int64)
    blk_kat = np.empty(m, np.int64)
    blk_at = np.empty(m, np.int64)
    blk_n = np.empty(m, np.int64)
    umap = np.full(m, -1, np.int64)
    ranges = np.empty((2 * m, 5), np.int64)  # fd, offset, length, kind, staging byte
    nb = 0
    nr = 0
    kstage = 0  # staged keys so far
    rstage = 0  # staged rows so far
    key_gap = max_gap // 8  # rows between two blocks' keys that still join one range
    row_gap = max_gap // max(row_bytes, 1)
    for t in range(ustart.size - 1):
        n = nrows[t]
        fd = tfd[t]
        rows_base = HEADER_BYTES + 16 * n
        k_first = -1  # first row of the open key run, its staging row
        k_at = 0
        r_first = -1
        r_at = 0
        end = 0  # the row after the previous block
        for u in range(ustart[t], ustart[t + 1]):
            b = ublock[u]
            lo = b * block_rows
            if lo >= n:  # positions outside the file: their key check fails
                break
            hi = min(n, lo + block_rows)
            if with_keys and k_first >= 0 and lo - end >= key_gap:
                nr = _close_run(ranges, nr, fd, HEADER_BYTES, k_first, end - k_first, 8, k_at, 0)
                kstage = k_at + end - k_first
                k_first = -1
            if r_first >= 0 and lo - end >= row_gap:
                nr = _close_run(ranges, nr, fd, rows_base, r_first, end - r_first, row_bytes, r_at, 1)
                rstage = r_at + end - r_first
                r_first = -1
            if with_keys and k_first < 0:
                k_first = lo
                k_at = kstage
            if r_first < 0:
                r_first = lo
                r_at = rstage
            blk_task[nb] = t
            blk_b[nb] = b
            blk_kat[nb] = k_at + lo - k_first if with_keys else -1
            blk_at[nb] = r_at + lo - r_first
            blk_n[nb] = hi - lo
            umap[u] = nb
            nb += 1
            end = hi
        if with_keys and k_first >= 0:
            nr = _close_run(ranges, nr, fd, HEADER_BYTES, k_first, end - k_first, 8, k_at, 0)
            kstage = k_at + end - k_first
        if r_first >= 0:
            nr = _close_run(ranges, nr, fd, rows_base, r_first, end - r_first, row_bytes, r_at, 1)
            rstage = r_at + end - r_first
    return (
        blk_task[:nb],
        blk_b[:nb],
        blk_kat[:nb],
        blk_at[:nb],
        blk_n[:nb],
        umap,
        ranges[:nr],
        kstage,
        rstage,
    )
