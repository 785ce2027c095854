"""Partial loads' block kernels (:mod:`~hpsray.tiers.ssd.reads`): how many checksummed blocks a
load's positions touch per file, and verifying staged blocks and picking the asked rows out of
them — with the blocks' keys staged (:func:`pick_staged`) or, for one-row blocks, with the keys
asked for in their place (:func:`pick_known`). The checksum is the file format's
(:func:`~hpsray.tiers.ssd.paramfile.span_sum`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from hpsray.kernels.table import readonly
from hpsray.tiers.ssd.paramfile import span_sum

__all__ = ["pick_known", "pick_staged", "touched_blocks", "touched_blocks_upto"]


@njit(cache=True, nogil=True)
def _pick_staged(skeys, srows, blk_b, blk_kat, blk_at, blk_n, expected, out, idx, pos, ublk, keys, block_rows):
    keys_u32 = skeys.view(np.uint32)
    width = srows.shape[1]
    rows_u32 = srows.reshape(-1).view(np.uint32)
    for u in range(blk_b.size):
        if span_sum(keys_u32, blk_kat[u], rows_u32, blk_at[u], blk_n[u], blk_b[u], width) != expected[u]:
            return u + 1
    for j in range(idx.size):
        u = ublk[j]
        i = idx[j]
        if u < 0:
            return -(j + 1)
        off = pos[j] - blk_b[u] * block_rows
        if skeys[blk_kat[u] + off] != keys[i]:
            return -(j + 1)
        r = blk_at[u] + off
        for c in range(width):
            out[i, c] = srows[r, c]
    return 0


def pick_staged(
    staged_keys: np.ndarray,
    staged_rows: np.ndarray,
    blocks: np.ndarray,
    key_at: np.ndarray,
    row_at: np.ndarray,
    block_n: np.ndarray,
    expected: np.ndarray,
    out: np.ndarray,
    idx: np.ndarray,
    pos: np.ndarray,
    block_of: np.ndarray,
    keys: np.ndarray,
    block_rows: int,
) -> int:
    """Verify blocks read into staging arrays and pick rows out of them (partial loads).

    Block ``u`` (number ``blocks[u]`` of its file) has ``block_n[u]`` rows: their keys from
    ``staged_keys[key_at[u]]`` on, their values from ``staged_rows[row_at[u]]`` on; its checksum
    must equal ``expected[u]`` (the file's block table). Then, for position ``pos[j]`` of block
    ``block_of[j]``, ``out[idx[j]]`` gets its staged row where its staged key equals
    ``keys[idx[j]]``. Returns 0, ``u + 1`` for the first bad block ``u``, or ``-(j + 1)`` for the
    first key mismatch (``block_of[j] < 0``: a position outside its file)."""
    r = _pick_staged(
        staged_keys,
        staged_rows,
        blocks,
        key_at,
        row_at,
        block_n,
        expected,
        out,
        idx,
        pos,
        block_of,
        readonly(keys),
        block_rows,
    )
    return int(r)


@njit(cache=True, nogil=True)
def _pick_known(srows, blk_b, blk_at, expected, out, idx, ublk, keys):
    keys_u32 = keys.view(np.uint32)
    width = srows.shape[1]
    rows_u32 = srows.reshape(-1).view(np.uint32)
    for j in range(idx.size):
        u = ublk[j]
        i = idx[j]
        if u < 0:
            return -(j + 1)
        if span_sum(keys_u32, i, rows_u32, blk_at[u], 1, blk_b[u], width) != expected[u]:
            return u + 1
        r = blk_at[u]
        for c in range(width):
            out[i, c] = srows[r, c]
    return 0


def pick_known(
    staged_rows: np.ndarray,
    blocks: np.ndarray,
    row_at: np.ndarray,
    expected: np.ndarray,
    out: np.ndarray,
    idx: np.ndarray,
    block_of: np.ndarray,
    keys: np.ndarray,
) -> int:
    """:func:`pick_staged` for one-row blocks read without their keys: the checksum of block
    ``block_of[j]`` (number ``blocks[u]``, its row staged at ``row_at[u]``) is computed over the
    key asked for, ``keys[idx[j]]``, and the staged row, so a row of another key fails it as a
    changed row would. Returns 0, ``u + 1`` for the first bad block, or ``-(j + 1)`` for a
    position outside its file."""
    return int(
        _pick_known(staged_rows, blocks, row_at, expected, out, idx, block_of, readonly(np.ascontiguousarray(keys)))
    )


def touched_blocks(pos: np.ndarray, starts: np.ndarray, groups: np.ndarray, block_rows: int) -> np.ndarray:
    """Distinct blocks of ``block_rows`` among the positions ``pos[starts[g]:starts[g+1]]`` of
    each file slot ``g`` in ``groups`` (:func:`touched_blocks_upto` without a limit)."""
    return touched_blocks_upto(pos, starts, groups, block_rows, np.full(groups.size, np.iinfo(np.int64).max - 1))


@njit(cache=True)
def touched_blocks_upto(pos, starts, groups, block_rows, limits):
    """:func:`touched_blocks`, but counting for group ``k`` only until the count passes
    ``limits[k]`` (then ``limits[k] + 1`` is returned for it): whether a file's requested rows lie
    in at most that many blocks, without reading all of a full load's positions."""
    out = np.zeros(groups.size, dtype=np.int64)
    top = 0
    for g in groups:
        for j in range(starts[g], starts[g + 1]):
            top = max(top, pos[j] // block_rows + 1)
    mark = np.zeros(top, dtype=np.bool_)
    for k in range(groups.size):
        g = groups[k]
        c = 0
        end = starts[g + 1]
        for j in range(starts[g], starts[g + 1]):
            b = pos[j] // block_rows
            if not mark[b]:
                mark[b] = True
                c += 1
                if c > limits[k]:
                    end = j + 1
                    break
        for j in range(starts[g], end):
            mark[pos[j] // block_rows] = False
        out[k] = c
    return out


# ``Any`` below: numpy arrays or bytes (numpy declares its buffer protocol to typing on Python >= 3.12 only)
