"""The on-disk layout for point reads, and the alignment rule shared by disk and GPU reads.

A *point store* is a directory built once from an export (:func:`build_point_store`)::

    point/
      meta.json   {"format": "hpsray-point-store", "version": 1, "dim", "rows", "stride",
                   "manifest_mtime_ns": the export (or delta) it was built from, "delta": its sequence}
      keys.u64    uint64[rows], sorted: row i of rows.f32 belongs to keys[i]
      rows.f32    rows at offset i * stride; each holds the dim float32 weights, zero-padded

A row is found by key without scanning (binary search of ``keys.u64``, memory-mapped) and read by
one positioned read of ``dim * 4`` bytes at ``i * stride``. ``stride`` (:func:`row_stride`) is a
power of two up to 128 bytes and a multiple of 128 beyond, so no row straddles a 128-byte segment
(a GPU warp reads it in aligned transactions) nor a 4 KiB block (a direct read of one block holds
whole rows); the file is padded to whole 4 KiB blocks. Optimizer state is not kept: serving reads
weights only.

An export with deltas (``delta-NNNNNN/``, docs/export.md) is laid out as the state after its last
delta that applies, in that delta's directory (``DIR/delta-NNNNNN/point/``): the layout of the
state before it (the previous delta's, else the base export's ``DIR/point/``, built first if
missing) is merged with the rows the deltas since then changed and removed, one pass over the
old layout in chunks, without reading the Parquet rows of the base again. Layouts older than the
previous one are removed afterwards (replicas still serving them keep their open files).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from hpsray.errors import ServingError
from hpsray.kernels.distinct import in_sorted

__all__ = [
    "BLOCK_BYTES",
    "FORMAT",
    "SEGMENT_BYTES",
    "build_point_store",
    "point_store_dir",
    "read_meta",
    "row_stride",
]

FORMAT = "hpsray-point-store"
VERSION = 1
SEGMENT_BYTES = 128  # a GPU warp's aligned transaction
BLOCK_BYTES = 4096  # a direct (O_DIRECT / GPUDirect Storage) read's unit
POINT_DIR = "point"
MERGE_CHUNK_ROWS = 1 << 20  # rows of the old layout per step of a delta merge


def row_stride(dim: int) -> int:
    """Bytes between consecutive rows of ``dim`` float32 weights (see the module docstring)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    nbytes = 4 * dim
    if nbytes <= SEGMENT_BYTES:
        return max(16, 1 << (nbytes - 1).bit_length())
    return -(-nbytes // SEGMENT_BYTES) * SEGMENT_BYTES


def point_store_dir(export_dir: str | os.PathLike) -> str:
    """Where the point store of an export (or of a delta directory) lives: inside it."""
    return os.path.join(os.fspath(export_dir), POINT_DIR)


def read_meta(directory: str) -> dict:
    """The checked ``meta.json`` of a point store directory."""
    path = os.path.join(directory, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ServingError(f"{path}: cannot read the point store's meta: {e}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ServingError(f"{path}: not a {FORMAT} version {VERSION}")
    return meta


def _manifest_ns(directory: str) -> int:
    return os.stat(os.path.join(directory, "manifest.json")).st_mtime_ns


def _current(target: str, stamp: int, rows: int, dim: int) -> bool:
    """Whether ``target`` holds a complete point store of the manifest stamped ``stamp``."""
    if not os.path.exists(os.path.join(target, "meta.json")):
        return False
    try:
        meta = read_meta(target)
    except ServingError:
        return False
    return meta.get("manifest_mtime_ns") == stamp and meta["rows"] == rows and meta["dim"] == dim


def _publish(tmp: str, target: str, replace: bool = False) -> None:
    """Move a finished store from ``tmp`` to ``target``, replacing an outdated one; concurrent
    builders (several replicas) race harmlessly: a store of the same state already there (another
    builder's, maybe being opened right now) is kept and ours dropped, else the first rename wins.
    ``replace``: replace it all the same (an explicit rebuild)."""
    if os.path.exists(target):
        mine = read_meta(tmp)
        if not replace and _current(target, mine["manifest_mtime_ns"], mine["rows"], mine["dim"]):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another builder's store landed first: keep it
        shutil.rmtree(tmp, ignore_errors=True)


def _write_meta(tmp: str, dim: int, rows: int, stride: int, stamp: int, delta: int) -> None:
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(
            {
                "format": FORMAT,
                "version": VERSION,
                "dim": dim,
                "rows": rows,
                "stride": stride,
                "manifest_mtime_ns": stamp,
                "delta": delta,
            },
            f,
        )


def build_point_store(export_dir: str | os.PathLike, *, rebuild: bool = False, chain: list[str] | None = None) -> str:
    """Lay the rows of an export (its deltas applied) out for point reads; returns the store's directory.

    ``chain``: the export's directories as :func:`hpsray.export.export_chain` lists them
    (the base, then each delta that applies); read from ``export_dir`` when not given. A caller
    that also reads the dense model passes the chain it used, so both are of the same state.

    Idempotent: an existing store of the same state (same last ``manifest.json``) is kept (unless
    ``rebuild``), one of an earlier export in the same directory is replaced; concurrent builders
    (several replicas) race harmlessly, the first rename wins.
    """
    from hpsray.export import export_chain, read_manifest

    export_dir = os.fspath(export_dir)
    manifest = read_manifest(export_dir)
    chain = list(chain) if chain is not None else export_chain(export_dir)
    if len(chain) == 1:
        return _build_base(export_dir, manifest, rebuild)
    return _build_delta(export_dir, manifest, chain, rebuild)


def _build_base(export_dir: str, manifest: dict, rebuild: bool) -> str:
    """The store of the base export alone, streamed from its Parquet files (one file's rows in memory)."""
    import pyarrow.parquet as pq

    stamp = _manifest_ns(export_dir)  # which export the store is of
    target = point_store_dir(export_dir)
    dim, n = int(manifest["dim"]), int(manifest["rows"])
    if not rebuild and _current(target, stamp, n, dim):
        return target
    stride = row_stride(dim)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    written = 0
    with open(os.path.join(tmp, "keys.u64"), "wb") as fk, open(os.path.join(tmp, "rows.f32"), "wb") as fr:
        last = None
        for entry in manifest["files"]:
            table = pq.read_table(os.path.join(export_dir, entry["path"]), columns=["key", "weights"])
            keys = table.column("key").to_numpy().astype(np.uint64, copy=False)
            w = table.column("weights").combine_chunks().flatten().to_numpy(zero_copy_only=False)
            w = w.astype(np.float32, copy=False).reshape(len(table), dim)
            if keys.size and ((last is not None and keys[0] <= last) or np.any(keys[1:] <= keys[:-1])):
                raise ServingError(f"{export_dir}/{entry['path']}: keys are not sorted and unique across files")
            fk.write(keys.tobytes())
            fr.write(_padded(w, stride).tobytes())
            written += keys.size
            last = keys[-1] if keys.size else last
        fr.write(b"\0" * ((-(written * stride)) % BLOCK_BYTES))
    if written != n:
        raise ServingError(f"{export_dir}: {written} rows in the files, the manifest says {n}")
    _write_meta(tmp, dim, n, stride, stamp, 0)
    _publish(tmp, target, replace=rebuild)
    return target


def _padded(weights: np.ndarray, stride: int) -> np.ndarray:
    out = np.zeros((weights.shape[0], stride // 4), np.float32)
    out[:, : weights.shape[1]] = weights
    return out


def _read_delta(path: str, m: dict, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(changed keys, their weights, removed keys)`` of one delta directory (manifest ``m``)."""
    import pyarrow.parquet as pq

    keys, weights, removed = [np.empty(0, np.uint64)], [np.empty((0, dim), np.float32)], [np.empty(0, np.uint64)]
    for entry in m["files"]:
        table = pq.read_table(os.path.join(path, entry["path"]), columns=["key", "weights"])
        keys.append(table.column("key").to_numpy().astype(np.uint64, copy=False))
        w = table.column("weights").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        weights.append(w.astype(np.float32, copy=False).reshape(len(table), dim))
    for entry in m.get("removed_files", []):
        table = pq.read_table(os.path.join(path, entry["path"]), columns=["key"])
        removed.append(table.column("key").to_numpy().astype(np.uint64, copy=False))
    return np.concatenate(keys), np.concatenate(weights), np.concatenate(removed)


def net_delta(deltas: list[tuple[str, dict]], dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The deltas ``[(directory, manifest), ...]`` applied in order, as one:
    ``(keys set, sorted; their weights; keys removed, sorted)`` (a key set after its removal is
    set; one removed after being set is removed)."""
    keys, weights = np.empty(0, np.uint64), np.empty((0, dim), np.float32)
    removed = np.empty(0, np.uint64)
    for path, m in deltas:
        dk, dw, rm = _read_delta(path, m, dim)
        rm = np.unique(rm)
        keep = ~in_sorted(keys, np.union1d(rm, dk))
        keys, weights = np.concatenate([keys[keep], dk]), np.concatenate([weights[keep], dw])
        order = np.argsort(keys, kind="stable")
        keys, weights = keys[order], weights[order]
        removed = np.union1d(removed[~in_sorted(removed, np.sort(dk))], rm)
    return keys, weights, removed


def _delta_manifest(path: str) -> dict:
    """A delta's ``manifest.json`` (:func:`~hpsray.export.export_chain` checked it)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ServingError(f"{path}/manifest.json: cannot read: {e}") from None


def _build_delta(export_dir: str, manifest: dict, chain: list[str], rebuild: bool) -> str:
    """The store of the state after the last delta of ``chain`` (see the module docstring)."""
    dim = int(manifest["dim"])
    deltas = [(path, _delta_manifest(path)) for path in chain[1:]]
    last_path, last = deltas[-1]
    target = point_store_dir(last_path)
    stamp = _manifest_ns(last_path)
    if not rebuild and _current(target, stamp, int(last["rows"]), dim):
        return target
    source = 0  # the newest earlier state whose store is current (the base's is built if need be)
    if not rebuild:
        for i in range(len(deltas) - 1, 0, -1):
            path, m = deltas[i - 1]
            if _current(point_store_dir(path), _manifest_ns(path), int(m["rows"]), dim):
                source = i
                break
    src = _build_base(export_dir, manifest, rebuild) if source == 0 else point_store_dir(deltas[source - 1][0])
    keys, weights, removed = net_delta(deltas[source:], dim)
    _merge(src, keys, weights, removed, target, stamp, int(last["sequence"]), int(last["rows"]), rebuild)
    for path in chain[:-2]:  # stores older than the previous one: nothing swaps to them any more
        shutil.rmtree(point_store_dir(path), ignore_errors=True)
    return target


def _merge(
    src: str,
    keys: np.ndarray,
    weights: np.ndarray,
    removed: np.ndarray,
    target: str,
    stamp: int,
    delta: int,
    expect_rows: int,
    replace: bool = False,
) -> None:
    """Write the store ``src`` with ``removed`` keys dropped and ``keys`` set to ``weights``
    (sorted) to ``target``: one pass over ``src`` in chunks of :data:`MERGE_CHUNK_ROWS` rows."""
    meta = read_meta(src)
    dim, stride, n = int(meta["dim"]), int(meta["stride"]), int(meta["rows"])
    width = stride // 4
    drop = np.union1d(removed, keys)
    old_keys = np.memmap(os.path.join(src, "keys.u64"), np.uint64, "r", shape=(n,)) if n else np.empty(0, np.uint64)
    old_rows = (
        np.memmap(os.path.join(src, "rows.f32"), np.float32, "r", shape=(n, width))
        if n
        else np.empty((0, width), np.float32)
    )
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    written, j = 0, 0
    with open(os.path.join(tmp, "keys.u64"), "wb") as fk, open(os.path.join(tmp, "rows.f32"), "wb") as fr:
        for c0 in range(0, max(n, 1), MERGE_CHUNK_ROWS):
            c1 = min(n, c0 + MERGE_CHUNK_ROWS)
            ck = np.asarray(old_keys[c0:c1])
            hi = int(np.searchsorted(keys, old_keys[c1])) if c1 < n else keys.size  # new keys before the next chunk
            keep = ~in_sorted(ck, drop)
            kept = ck[keep]
            at = np.searchsorted(kept, keys[j:hi]) + np.arange(hi - j)  # where the set keys go, in order
            mk = np.empty(kept.size + at.size, np.uint64)
            mr = np.empty((mk.size, width), np.float32)
            old_at = np.ones(mk.size, bool)
            old_at[at] = False
            mk[at], mk[old_at] = keys[j:hi], kept
            mr[at] = _padded(weights[j:hi], stride)
            mr[old_at] = old_rows[c0:c1][keep]
            j = hi
            fk.write(mk.data)
            fr.write(mr.data)
            written += mk.size
        fr.write(b"\0" * ((-(written * stride)) % BLOCK_BYTES))
    del old_keys, old_rows
    if written != expect_rows:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ServingError(f"{target}: {written} rows after applying the deltas, the manifest says {expect_rows}")
    _write_meta(tmp, dim, written, stride, stamp, delta)
    _publish(tmp, target, replace)
