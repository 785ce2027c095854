"""Categorical columns (Arrow arrays) → ``uint64`` keys and the CSR layout of a ``Batch``.

A raw value becomes a key in two steps: the value is turned into a ``uint64``
(``"string"``: a 64-bit hash of its bytes; ``"hex"`` / ``"int"``: the parsed number; Arrow
integer columns: the integer itself), then mixed with its slot by the same arithmetic as
:func:`hpsray.data.keys.hash_keys`. Both steps run in one numba pass over the Arrow buffers.
Null and empty values give no key; a value that does not parse is reported per row.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hpsray.data.keys import slot_salt
from hpsray.kernels.hashing import EMPTY_KEY, mix64

MODE_STRING, MODE_HEX, MODE_INT = 0, 1, 2
_MODES = {"string": MODE_STRING, "hex": MODE_HEX, "int": MODE_INT}
_STR_SEED = np.uint64(0x243F6A8885A308D3)
_STR_MUL = np.uint64(0x9FB21C651E98DF25)
_ONE = np.uint64(1)
_EMPTY = EMPTY_KEY
_EMPTY_M1 = EMPTY_KEY - np.uint64(1)


@nb.njit(cache=True, inline="always")
def _slot_key(value, salt):
    k = mix64(value ^ salt)
    if k == _EMPTY:
        k = _EMPTY_M1
    return k


@nb.njit(cache=True)
def _hash_bytes(data, lo, hi):
    """64-bit hash of ``data[lo:hi]``: 8-byte little-endian words, multiply-xorshift, mix64."""
    h = _STR_SEED ^ (np.uint64(hi - lo) * _STR_MUL)
    p = lo
    while p + 8 <= hi:
        w = np.uint64(0)
        for j in range(8):
            w |= np.uint64(data[p + j]) << np.uint64(8 * j)
        h = (h ^ w) * _STR_MUL
        h ^= h >> np.uint64(29)
        p += 8
    if p < hi:
        w = np.uint64(0)
        for j in range(hi - p):
            w |= np.uint64(data[p + j]) << np.uint64(8 * j)
        h = (h ^ w) * _STR_MUL
        h ^= h >> np.uint64(29)
    return mix64(h)


def _digit_table(alphabet: bytes, upper: bool) -> np.ndarray:
    t = np.full(256, 255, np.uint8)
    for i, ch in enumerate(alphabet):
        t[ch] = i
        if upper:
            t[ord(chr(ch).upper())] = i
    return t


# Digit value per byte, 255 for "not a digit": a table lookup instead of branches, which
# mispredict on random hex text (5x faster on Criteo's categorical columns).
_HEX_DIGITS = _digit_table(b"0123456789abcdef", True)
_DEC_DIGITS = _digit_table(b"0123456789", False)


@nb.njit(cache=True)
def _parse_number(data, lo, hi, mode):
    """(value, ok) for hex or signed decimal text in ``data[lo:hi]`` (surrounding spaces allowed)."""
    while lo < hi and (data[lo] == 32 or data[lo] == 9):
        lo += 1
    while hi > lo and (data[hi - 1] == 32 or data[hi - 1] == 9 or data[hi - 1] == 13):
        hi -= 1
    if lo >= hi:
        return np.uint64(0), False
    v = np.uint64(0)
    acc = np.uint8(0)
    if mode == MODE_HEX:
        if hi - lo > 2 and data[lo] == 48 and (data[lo + 1] == 120 or data[lo + 1] == 88):
            lo += 2
        if hi - lo > 16:
            return v, False
        for p in range(lo, hi):
            d = _HEX_DIGITS[data[p]]
            acc |= d
            v = (v << np.uint64(4)) | np.uint64(d)
        return v, acc < 16
    neg = False
    if data[lo] == 45 or data[lo] == 43:
        neg = data[lo] == 45
        lo += 1
        if lo >= hi:
            return v, False
    if hi - lo > 20:
        return v, False
    for p in range(lo, hi):
        d = _DEC_DIGITS[data[p]]
        acc |= d
        nv = v * np.uint64(10) + np.uint64(d)
        if nv < v or (p - lo >= 19 and v > np.uint64(1844674407370955161)):
            return v, False  # overflow
        v = nv
    if acc > 15:  # a 255 "not a digit" was OR-ed in
        return v, False
    if neg:
        v = (~v) + _ONE  # two's complement: int64 -1 and "-1" give the same key
    return v, True


@nb.njit(cache=True, inline="always")
def _parse_fast(data, lo, hi, mode):
    """Plain hex digits or plain decimal digits only; anything else goes to ``_parse_number``."""
    v = np.uint64(0)
    acc = np.uint8(0)
    if mode == MODE_HEX:
        if hi - lo > 16:
            return v, False
        for p in range(lo, hi):
            d = _HEX_DIGITS[data[p]]
            acc |= d
            v = (v << np.uint64(4)) | np.uint64(d)
        return v, acc < 16
    if hi - lo > 19:  # 19 decimal digits cannot overflow a uint64
        return v, False
    for p in range(lo, hi):
        d = _DEC_DIGITS[data[p]]
        acc |= d
        v = v * np.uint64(10) + np.uint64(d)
    return v, acc < 16


@nb.njit(cache=True, inline="always")
def _parse_value(data, lo, hi, mode):
    v, ok = _parse_fast(data, lo, hi, mode)
    if not ok:
        v, ok = _parse_number(data, lo, hi, mode)  # spaces, 0x, signs, 20 digits, or bad
    return v, ok


@nb.njit(cache=True)
def _encode_strings(offsets, data, valid, has_valid, arr_off, n, mode, salt, keys, counts, bad):
    """One key per non-null, non-empty string; ``counts[i]`` is 0 or 1, ``bad[i]`` marks parse errors."""
    m = 0
    for i in range(n):
        j = i + arr_off
        if has_valid and not ((valid[j >> 3] >> (j & 7)) & 1):
            counts[i] = 0
            continue
        lo = offsets[j]
        hi = offsets[j + 1]
        if lo == hi:
            counts[i] = 0
            continue
        if mode == MODE_STRING:
            v = _hash_bytes(data, lo, hi)
        else:
            v, ok = _parse_value(data, lo, hi, mode)
            if not ok:
                bad[i] = True
                counts[i] = 0
                continue
        keys[m] = _slot_key(v, salt)
        counts[i] = 1
        m += 1
    return m


@nb.njit(cache=True)
def _encode_ints(values, valid, has_valid, arr_off, n, salt, keys, counts):
    m = 0
    for i in range(n):
        j = i + arr_off
        if has_valid and not ((valid[j >> 3] >> (j & 7)) & 1):
            counts[i] = 0
            continue
        keys[m] = _slot_key(values[j], salt)
        counts[i] = 1
        m += 1
    return m


@nb.njit(cache=True)
def _regroup(list_offsets, elem_counts, n, counts):
    """Per-row key counts from list offsets and per-element counts (0/1)."""
    for i in range(n):
        c = 0
        for e in range(list_offsets[i], list_offsets[i + 1]):
            c += elem_counts[e]
        counts[i] = c


@nb.njit(cache=True)
def _bad_rows_of_elements(list_offsets, elem_bad, n, bad):
    for i in range(n):
        for e in range(list_offsets[i], list_offsets[i + 1]):
            if elem_bad[e]:
                bad[i] = True
                break


def _bitmap(arr: pa.Array) -> tuple[np.ndarray, bool]:
    buf = arr.buffers()[0]
    if buf is None or arr.null_count == 0:
        return np.zeros(1, np.uint8), False
    return np.frombuffer(buf, dtype=np.uint8), True


def _encode_flat(arr: pa.Array, salt: np.uint64, mode: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(keys, counts 0/1 per element, bad per element or None) for a flat Arrow array."""
    n = len(arr)
    t = arr.type
    keys = np.empty(n, np.uint64)
    counts = np.empty(n, np.int64)
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_integer(t):
        if t != pa.int64() and t != pa.uint64():
            arr = arr.cast(pa.int64())
        valid, has_valid = _bitmap(arr)
        values = np.frombuffer(arr.buffers()[1], dtype=np.uint64)
        m = _encode_ints(values, valid, has_valid, arr.offset, n, salt, keys, counts)
        return keys[:m], counts, None
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        off_dtype = np.int64
    elif pa.types.is_string(t) or pa.types.is_binary(t):
        off_dtype = np.int32
    elif pa.types.is_null(t):
        counts[:] = 0
        return keys[:0], counts, None
    else:
        arr = arr.cast(pa.string())
        off_dtype = np.int32
    valid, has_valid = _bitmap(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_dtype)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    bad = np.zeros(n, np.bool_)
    m = _encode_strings(offsets, data, valid, has_valid, arr.offset, n, mode, salt, keys, counts, bad)
    return keys[:m], counts, (bad if mode != MODE_STRING else None)


def encode_column(
    arr: pa.Array, slot: int, encoding: str = "string", multi_hot_separator: str = ""
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Keys of one categorical column.

    Returns ``(keys u64[nnz], counts i64[n], bad bool[n] | None)``: the keys of all rows in row
    order, how many keys each row has, and the rows whose value did not parse (``None`` when no
    row can fail). List columns and ``multi_hot_separator`` give several keys per row.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    mode = _MODES[encoding]
    salt = np.uint64(slot_salt(slot))
    n = len(arr)
    if multi_hot_separator and (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = pc.split_pattern(arr, multi_hot_separator)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        if arr.null_count:
            arr = pc.fill_null(arr, pa.scalar([], type=arr.type))
        list_offsets = np.asarray(arr.offsets, dtype=np.int64)  # into arr.values, honours slicing
        lo, hi = int(list_offsets[0]), int(list_offsets[-1])
        elem_keys, elem_counts, elem_bad = _encode_flat(arr.values.slice(lo, hi - lo), salt, mode)
        rel = list_offsets - lo
        counts = np.empty(n, np.int64)
        _regroup(rel, elem_counts, n, counts)
        bad = None
        if elem_bad is not None and elem_bad.any():
            bad = np.zeros(n, np.bool_)
            _bad_rows_of_elements(rel, elem_bad, n, bad)
        return elem_keys, counts, bad
    keys, counts, bad = _encode_flat(arr, salt, mode)
    return keys, counts, bad


@nb.njit(cache=True)
def _assemble(all_keys, col_base, col_counts, keep, out_keys, out_slots, out_offsets):
    n_cols, n = col_counts.shape
    pos = 0
    row = 0
    cursor = col_base.copy()
    out_offsets[0] = 0
    for i in range(n):
        if keep[i]:
            for c in range(n_cols):
                k = col_counts[c, i]
                for j in range(k):
                    out_keys[pos] = all_keys[cursor[c] + j]
                    out_slots[pos] = c
                    pos += 1
        for c in range(n_cols):
            cursor[c] += col_counts[c, i]
        if keep[i]:
            row += 1
            out_offsets[row] = pos
    return pos


def assemble_csr(
    columns: list[tuple[np.ndarray, np.ndarray]], n: int, keep: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR ``(keys u64, offsets i64[B+1], slots i32)`` from per-slot ``(keys, counts)``.

    Slot ``c`` is ``columns[c]``; within an example keys are ordered by slot. Rows with
    ``keep[i] == False`` are dropped (``B`` = number of kept rows).
    """
    if keep is None:
        keep = np.ones(n, np.bool_)
    n_cols = len(columns)
    if n_cols == 0:
        b = int(keep.sum())
        return np.zeros(0, np.uint64), np.zeros(b + 1, np.int64), np.zeros(0, np.int32)
    all_keys = np.concatenate([k for k, _ in columns]) if n_cols > 1 else columns[0][0]
    col_base = np.zeros(n_cols, np.int64)
    col_base[1:] = np.cumsum([len(k) for k, _ in columns])[:-1]
    col_counts = np.stack([c for _, c in columns])
    total = int(col_counts[:, keep].sum()) if n else 0
    out_keys = np.empty(total, np.uint64)
    out_slots = np.empty(total, np.int32)
    out_offsets = np.empty(int(keep.sum()) + 1, np.int64)
    _assemble(all_keys, col_base, col_counts, keep, out_keys, out_slots, out_offsets)
    return out_keys, out_offsets, out_slots


def hash_strings(arr: pa.Array | list[str]) -> np.ndarray:
    """The ``uint64`` that the ``"string"`` encoding gives each value (before the slot mix).

    Nulls and empty strings map to 0 here (the readers give them no key at all).
    """
    if not isinstance(arr, (pa.Array, pa.ChunkedArray)):
        arr = pa.array(arr, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    out = np.zeros(len(arr), np.uint64)
    _hash_all(arr, out)
    return out


def _hash_all(arr: pa.Array, out: np.ndarray) -> None:
    bufs = arr.buffers()
    off_dtype = np.int64 if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=off_dtype)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    valid, has_valid = _bitmap(arr)
    _hash_all_kernel(offsets, data, valid, has_valid, arr.offset, len(arr), out)


@nb.njit(cache=True)
def _hash_all_kernel(offsets, data, valid, has_valid, arr_off, n, out):
    for i in range(n):
        j = i + arr_off
        if has_valid and not ((valid[j >> 3] >> (j & 7)) & 1):
            continue
        if offsets[j] < offsets[j + 1]:
            out[i] = _hash_bytes(data, offsets[j], offsets[j + 1])


@nb.njit(cache=True)
def _encode_rows(offs, datas, valids, has_valid, arr_offs, n, mode, salts, out_keys, out_slots, out_offsets, bad):
    """All single-valued string columns at once, row by row, straight into CSR order."""
    n_cols = len(offs)
    pos = 0
    out_offsets[0] = 0
    for i in range(n):
        for c in range(n_cols):
            j = i + arr_offs[c]
            if has_valid[c]:
                vb = valids[c]
                if not ((vb[j >> 3] >> (j & 7)) & 1):
                    continue
            o = offs[c]
            lo = o[j]
            hi = o[j + 1]
            if lo == hi:
                continue
            d = datas[c]
            if mode == MODE_STRING:
                v = _hash_bytes(d, lo, hi)
            else:
                v, ok = _parse_value(d, lo, hi, mode)
                if not ok:
                    bad[i] = True
                    continue
            out_keys[pos] = _slot_key(v, salts[c])
            out_slots[pos] = c
            pos += 1
        out_offsets[i + 1] = pos
    return pos


def _is_flat_string(arr: pa.Array) -> bool:
    t = arr.type
    return pa.types.is_string(t) or pa.types.is_binary(t)


def encode_single_columns(
    arrays: list[pa.Array], encoding: str = "string"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Fast path for one value per slot in ``string``/``binary`` columns (Criteo, plain CSV).

    Returns ``(keys, offsets, slots, bad)`` for all rows, slot ``c`` = ``arrays[c]``, or ``None``
    when the columns do not qualify (other types: use :func:`encode_column`).
    """
    arrays = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
    if not arrays or not all(_is_flat_string(a) for a in arrays):
        return None
    n = len(arrays[0])
    empty = np.zeros(1, np.uint8)
    offs, datas, valids = [], [], []
    has_valid = np.zeros(len(arrays), np.bool_)
    arr_offs = np.zeros(len(arrays), np.int64)
    for c, a in enumerate(arrays):
        bufs = a.buffers()
        offs.append(np.frombuffer(bufs[1], dtype=np.int32))
        datas.append(np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else empty)
        v, hv = _bitmap(a)
        valids.append(v)
        has_valid[c] = hv
        arr_offs[c] = a.offset
    salts = slot_salt(np.arange(len(arrays))).astype(np.uint64)
    cap = n * len(arrays)
    keys = np.empty(cap, np.uint64)
    slots = np.empty(cap, np.int32)
    offsets = np.empty(n + 1, np.int64)
    bad = np.zeros(n, np.bool_)
    m = _encode_rows(
        tuple(offs),
        tuple(datas),
        tuple(valids),
        has_valid,
        arr_offs,
        n,
        _MODES[encoding],
        salts,
        keys,
        slots,
        offsets,
        bad,
    )
    return keys[:m], offsets, slots[:m], bad


def drop_rows(
    keys: np.ndarray, offsets: np.ndarray, slots: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR without the rows where ``keep`` is False."""
    counts = np.diff(offsets)
    key_keep = np.repeat(keep, counts)
    new_counts = counts[keep]
    new_offsets = np.zeros(len(new_counts) + 1, np.int64)
    np.cumsum(new_counts, out=new_offsets[1:])
    return keys[key_keep], new_offsets, slots[key_keep]
