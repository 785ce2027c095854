"""Bulk-loading a table of rows (a Parquet export) straight into an empty SSD-PS.

The import directory is hpsray's own export (``manifest.json`` listing ``rows-*.parquet``,
docs/export.md) or any directory of ``*.parquet`` files with the columns

* ``key``: unsigned (or non-negative) integers, unique over all files;
* ``row`` or ``weights``: ``fixed_size_list`` / ``list`` of floats, ``dim`` long (the embedding);
* ``state`` (optional): ``state_width`` floats (the sparse optimizer's state); absent, every
  row starts with the optimizer's initial state, as a new row would.

:func:`bulk_load` streams the files in record batches, converts columns with numpy (no Python per
row), writes parameter files of ``rows_per_file`` rows sequentially under temporary names and
places their keys in the key map as each file is written; it records the files in one manifest
edit only after every file was read, checked and fsynced. Any error (a malformed or partial
import, a full disk) removes what was written and leaves the store empty: nothing is half
loaded, and the error names the file and the column. :func:`read_table` reads the same
directory into memory (or only some keys of it), for an in-memory trainer and for tests.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpsray.errors import SSDError, TableImportError
from hpsray.fileio import FULL_ERRNOS, fsync_dir, fsync_path, full_error, unlink_quiet
from hpsray.tables import TAG_SHIFT
from hpsray.tiers.ssd.files import FileTable
from hpsray.tiers.ssd.keymap import KeyMap
from hpsray.tiers.ssd.paramfile import file_bytes, file_name, write_tmp
from hpsray.tiers.ssd.state import StoreState

__all__ = ["TableImport", "bulk_load", "declared_rows", "import_files", "iter_table", "narrow", "read_table"]

ROW_COLUMNS = ("row", "weights")
BATCH_ROWS = 1 << 18  # rows per Parquet record batch read


@dataclass(frozen=True)
class TableImport:
    """What ``[tiers] init_from`` asks the SSD-PS of a fresh job to load: the directory, the
    embedding width ``dim`` (the rest of a row is optimizer state) and the state's initial value
    (for tables without a ``state`` column). For one row group of tables of several layouts
    (an export of them, docs/export.md "Tables"): ``columns``, the export's ``(weights,
    state)`` widths (the widest table's: a row's own then zeros), and ``tags``, the group's
    tables (the keys' top byte) whose keys the store takes."""

    path: str
    dim: int
    state_value: float = 0.0
    columns: tuple[int, int] | None = None
    tags: tuple[int, ...] | None = None

    def read_width(self, width: int) -> tuple[int, int]:
        """``(weights, floats)`` a row of the import is read as, for a store of ``width``."""
        if self.columns is None:
            return self.dim, width
        return self.columns[0], self.columns[0] + self.columns[1]

    def select(self, keys: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows read (``rows`` of ``keys``, :meth:`read_width`) that the store takes, at its
        ``width``: those of ``tags`` (all without), each its ``dim`` weights then its state."""
        if self.tags is not None:
            mine = np.isin((keys >> TAG_SHIFT).astype(np.int64), np.asarray(self.tags, np.int64))
            keys, rows = keys[mine], rows[mine]
        if self.columns is None:
            return keys, rows
        return keys, narrow(rows, self.columns[0], self.dim, width)


def narrow(rows: np.ndarray, read_dim: int, dim: int, width: int) -> np.ndarray:
    """Rows of ``read_dim`` weights then state (an export of tables of several layouts) as rows
    of their table's ``dim`` weights and ``width - dim`` state."""
    out = np.empty((rows.shape[0], width), np.float32)
    out[:, :dim] = rows[:, :dim]
    out[:, dim:] = rows[:, read_dim : read_dim + width - dim]
    return out


def import_files(directory: str) -> list[tuple[str, int | None]]:
    """The Parquet files of an import directory with the rows each should hold (``None``:
    unknown), in order. An hpsray export's ``manifest.json`` names them; otherwise every
    ``*.parquet`` file, sorted by name. Raises :class:`TableImportError` for a missing directory,
    an unreadable manifest, an export with deltas, a listed file that is missing, or no files."""
    if not os.path.isdir(directory):
        raise TableImportError(f"init_from {directory}: not a directory")
    manifest = os.path.join(directory, "manifest.json")
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                meta = json.load(f)
            listed = [(os.path.join(directory, e["path"]), int(e["rows"])) for e in meta["files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TableImportError(f"{manifest}: not a readable hpsray export manifest ({e})") from e
        deltas = sorted(n for n in os.listdir(directory) if n.startswith("delta-"))
        if deltas:
            raise TableImportError(
                f"{directory}: holds incremental exports ({deltas[0]}, ...); init_from loads a full "
                "export: export again without --incremental"
            )
        for path, _ in listed:
            if not os.path.isfile(path):
                raise TableImportError(f"{path}: listed in {manifest} but missing (a partial export)")
        files: list[tuple[str, int | None]] = list(listed)
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".parquet"))
        files = [(os.path.join(directory, n), None) for n in names]
    if not files:
        raise TableImportError(f"init_from {directory}: no Parquet files (and no manifest.json)")
    return files


def _floats(col: Any, path: str, name: str, width: int) -> np.ndarray:
    """A list column as ``float32[n, width]`` without a Python loop; refuses nulls and rows of
    another length, naming the file and column."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        raise TableImportError(f"{path}: column {name!r} has {arr.null_count} null rows")
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        if t.list_size != width:
            raise TableImportError(f"{path}: column {name!r} holds {t.list_size} floats per row, expected {width}")
        values = arr.values.slice(arr.offset * width, len(arr) * width)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = arr.offsets.to_numpy(zero_copy_only=False)
        lengths = np.diff(offsets)
        if lengths.size and (lengths != width).any():
            bad = int(np.flatnonzero(lengths != width)[0])
            raise TableImportError(
                f"{path}: column {name!r}, row {bad}: {int(lengths[bad])} floats, expected {width} in every row"
            )
        values = arr.values.slice(int(offsets[0]), len(arr) * width) if len(arr) else arr.values.slice(0, 0)
    else:
        raise TableImportError(f"{path}: column {name!r} has type {t}, expected a list of {width} floats")
    if not pa.types.is_floating(values.type):
        raise TableImportError(f"{path}: column {name!r} holds {values.type}, expected floats")
    if values.null_count:
        raise TableImportError(f"{path}: column {name!r} has null values inside its rows")
    out = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return out.reshape(len(arr), width)


def _keys(col: Any, path: str) -> np.ndarray:
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not pa.types.is_integer(arr.type):
        raise TableImportError(f"{path}: column 'key' has type {arr.type}, expected unsigned 64-bit integers")
    if arr.null_count:
        raise TableImportError(f"{path}: column 'key' has {arr.null_count} null keys")
    keys = arr.to_numpy(zero_copy_only=False)
    if pa.types.is_signed_integer(arr.type) and keys.size and keys.min() < 0:
        raise TableImportError(f"{path}: column 'key' has negative keys (row {int(np.argmin(keys))})")
    keys = keys.astype(np.uint64, copy=False)
    if keys.size and (keys == np.uint64(2**64 - 1)).any():
        raise TableImportError(f"{path}: key 2**64-1 is reserved (the hash tables' empty marker)")
    return keys


def iter_table(
    directory: str, dim: int, width: int, state_value: float = 0.0, batch_rows: int = BATCH_ROWS
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield ``(file, keys uint64[n], rows float32[n, width])`` record batch by record batch;
    rows are the ``dim`` weights then the state (``state_value`` where the file has none).
    Checks every file's columns and, for an export, its row count (:class:`TableImportError`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    state_width = width - dim
    for path, expect in import_files(directory):
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise TableImportError(f"{path}: not a readable Parquet file ({e})") from e
        names = pf.schema_arrow.names
        if "key" not in names:
            raise TableImportError(f"{path}: no 'key' column (columns: {', '.join(names)})")
        row_col = next((c for c in ROW_COLUMNS if c in names), None)
        if row_col is None:
            raise TableImportError(f"{path}: no 'row' (or 'weights') column (columns: {', '.join(names)})")
        has_state = "state" in names
        if has_state and state_width == 0:
            raise TableImportError(f"{path}: has a 'state' column but the job's sparse optimizer keeps no state")
        if expect is not None and pf.metadata.num_rows != expect:
            raise TableImportError(
                f"{path}: {pf.metadata.num_rows} rows, the export's manifest says {expect} (a partial export)"
            )
        columns = ["key", row_col] + (["state"] if has_state else [])
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                keys = _keys(batch.column(0), path)
                rows = np.empty((keys.size, width), dtype=np.float32)
                rows[:, :dim] = _floats(batch.column(1), path, row_col, dim)
                if has_state:
                    rows[:, dim:] = _floats(batch.column(2), path, "state", state_width)
                else:
                    rows[:, dim:] = state_value
                yield path, keys, rows
        except (OSError, pa.ArrowException) as e:
            raise TableImportError(f"{path}: cannot be read ({e})") from e


def read_table(
    directory: str, dim: int, width: int, state_value: float = 0.0, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The import's ``(keys sorted, rows)`` in memory; with ``keys``, only the rows of those
    keys (the ones a training touches), read batch by batch so memory stays that small."""
    want = None if keys is None else np.unique(np.asarray(keys, dtype=np.uint64))
    ks, rs = [], []
    for _, k, r in iter_table(directory, dim, width, state_value):
        if want is not None:
            pos = np.minimum(np.searchsorted(want, k), max(want.size - 1, 0))
            sel = want[pos] == k if want.size else np.zeros(k.size, dtype=bool)
            k, r = k[sel], r[sel]
        ks.append(k)
        rs.append(r)
    all_k = np.concatenate(ks) if ks else np.empty(0, np.uint64)
    all_r = np.concatenate(rs) if rs else np.empty((0, width), np.float32)
    order = np.argsort(all_k, kind="stable")
    all_k, all_r = all_k[order], all_r[order]
    if all_k.size > 1 and (all_k[1:] == all_k[:-1]).any():
        dup = int(all_k[1:][all_k[1:] == all_k[:-1]][0])
        raise TableImportError(f"init_from {directory}: key {dup} appears more than once")
    return all_k, all_r


def bulk_load(
    store: StoreState, spec: TableImport, shard: tuple[int, int] | None = None, batch_rows: int = BATCH_ROWS
) -> dict:
    """Load the table ``spec`` names into a store (``store``: its shared state), which must be empty (see the module
    docstring); ``shard=(node, n_nodes)`` keeps only the keys that node owns. Returns
    ``{"rows", "files", "bytes", "source_files", "seconds"}``.

    Raises :class:`TableImportError` (bad input; the store stays empty), :class:`SSDError` for a
    store that already holds rows, :class:`~hpsray.errors.SSDFullError` when the disk fills.
    """
    from hpsray.tiers.partition import owner_of

    t0 = time.perf_counter()
    width, rpf = store.width, store.rows_per_file
    if not 0 < spec.dim <= width:
        raise TableImportError(f"init_from {spec.path}: dim {spec.dim} does not fit rows of width {width}")
    read_dim, read_width = spec.read_width(width)
    with store.dump_lock, store.compaction_lock:
        store.check_open()
        with store.lock:
            if store.keys.size or len(store.files):
                raise SSDError(
                    f"SSD-PS {store.directory} already holds {store.keys.size} rows; init_from loads "
                    "into an empty store (remove the directory, or drop init_from to keep training it)"
                )
        n_shards = shard[1] if shard is not None else 1
        kmap = KeyMap(declared_rows(spec.path) // n_shards)  # sized once: 20 bytes per key, no rebuilds
        files = FileTable()
        tmps: list[str] = []
        nos: list[int] = []
        syncs: list[Future] = []
        buf_k = np.empty(rpf, dtype=np.uint64)
        buf_r = np.empty((rpf, width), dtype=np.float32)
        fill = 0
        sources: set[str] = set()
        written = 0
        current = spec.path  # the file the buffered rows came from last

        def flush(path: str) -> None:
            nonlocal fill, written
            if fill == 0:
                return
            (no,) = store.allocate_file_numbers(1)
            k, r = buf_k[:fill], buf_r[:fill]
            before = kmap.size
            seen = kmap.find(k) >= 0
            if seen.any():
                _duplicate(int(k[np.argmax(seen)]), path, spec.path)
            kmap.grow(fill)
            versions = np.full(fill, no, dtype=np.uint64)
            tmp, size, table = write_tmp(store.directory, no, k, versions, r, 0, store.write, fsync=False)
            tmps.append(tmp)
            nos.append(no)
            syncs.append(store.pool.submit(fsync_path, tmp))
            s = files.add(no, fill, size, fill, 0, table)
            kmap.place(k, np.int32(s), np.arange(fill, dtype=np.int32))
            if kmap.size - before != fill:  # a key twice in this file
                sk = np.sort(k)
                _duplicate(int(sk[1:][sk[1:] == sk[:-1]][0]), path, spec.path)
            written += size
            fill = 0

        try:
            for path, keys, rows in iter_table(spec.path, read_dim, read_width, spec.state_value, batch_rows):
                sources.add(path)
                current = path
                keys, rows = spec.select(keys, rows, width)
                if shard is not None and shard[1] > 1:
                    mine = owner_of(keys, shard[1]) == shard[0]
                    keys, rows = keys[mine], rows[mine]
                at = 0
                while at < keys.size:
                    take = min(rpf - fill, keys.size - at)
                    buf_k[fill : fill + take] = keys[at : at + take]
                    buf_r[fill : fill + take] = rows[at : at + take]
                    fill += take
                    at += take
                    if fill == rpf:
                        flush(path)
            flush(current)
            for fut in syncs:
                fut.result()
            for no, tmp in zip(nos, tmps):
                os.rename(tmp, os.path.join(store.directory, file_name(no)))
            fsync_dir(store.directory)
            if nos:
                store.manifest.append(add=nos, next_file_no=nos[-1] + 1)
        except BaseException as e:
            for fut in syncs:
                fut.exception()  # wait: none may still write a file being removed
            for no, tmp in zip(nos, tmps):
                unlink_quiet(tmp)
                unlink_quiet(os.path.join(store.directory, file_name(no)))
            if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
                needed = written + file_bytes(rpf, width)
                raise full_error(e, store.directory, needed, f"importing {spec.path}", "nothing was imported") from e
            raise
        with store.lock:
            store.keys, store.files = kmap, files
            st = store.stats
            st["rows_dumped"] += kmap.size
            st["bytes_written"] += written
            st["files_written"] += len(nos)
        store.manifest.maybe_rewrite()
    return {
        "rows": kmap.size,
        "files": len(nos),
        "bytes": written,
        "source_files": len(sources),
        "seconds": time.perf_counter() - t0,
    }


def declared_rows(directory: str) -> int:
    """Rows the import's Parquet footers declare (0 where a file cannot be read: the import
    itself then names it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = 0
    for path, _ in import_files(directory):
        try:
            total += pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException):
            pass
    return total


def _duplicate(key: int, path: str, directory: str) -> None:
    raise TableImportError(f"{path}: key {key} appears more than once in init_from {directory} (keys must be unique)")
