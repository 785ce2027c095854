"""The on-disk layout for point reads, and the alignment rule shared by disk and GPU reads.

A *point store* is a directory built once from an export (:func:`build_point_store`)::

    point/
      meta.json   {"format": "hpsray-point-store", "version": 1, "dim", "rows", "stride",
                   "manifest_mtime_ns": the export it was built from}
      keys.u64    uint64[rows], sorted: row i of rows.f32 belongs to keys[i]
      rows.f32    rows at offset i * stride; each holds the dim float32 weights, zero-padded

A row is found by key without scanning (binary search of ``keys.u64``, memory-mapped) and read by
one positioned read of ``dim * 4`` bytes at ``i * stride``. ``stride`` (:func:`row_stride`) is a
power of two up to 128 bytes and a multiple of 128 beyond, so no row straddles a 128-byte segment
(a GPU warp reads it in aligned transactions) nor a 4 KiB block (a direct read of one block holds
whole rows); the file is padded to whole 4 KiB blocks. Optimizer state is not kept: serving reads
weights only.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from hpsray.serving.errors import ServingError

__all__ = ["BLOCK_BYTES", "FORMAT", "SEGMENT_BYTES", "build_point_store", "point_store_dir", "read_meta", "row_stride"]

FORMAT = "hpsray-point-store"
VERSION = 1
SEGMENT_BYTES = 128  # a GPU warp's aligned transaction
BLOCK_BYTES = 4096  # a direct (O_DIRECT / GPUDirect Storage) read's unit
POINT_DIR = "point"


def row_stride(dim: int) -> int:
    """Bytes between consecutive rows of ``dim`` float32 weights (see the module docstring)."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    nbytes = 4 * dim
    if nbytes <= SEGMENT_BYTES:
        return max(16, 1 << (nbytes - 1).bit_length())
    return -(-nbytes // SEGMENT_BYTES) * SEGMENT_BYTES


def point_store_dir(export_dir: str | os.PathLike) -> str:
    """Where the point store of an export lives (inside the export directory)."""
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


def build_point_store(export_dir: str | os.PathLike, *, rebuild: bool = False) -> str:
    """Lay the rows of an export out for point reads; returns the store's directory.

    Streams the export's Parquet files (already sorted by key) one at a time, so memory stays at
    one file's rows. Idempotent: an existing store of the same export (same ``manifest.json``) is
    kept (unless ``rebuild``), one of an earlier export in the same directory is replaced;
    concurrent builders (several replicas) race harmlessly, the first rename wins.
    """
    import pyarrow.parquet as pq

    from hpsray.pipelines.export import read_manifest

    export_dir = os.fspath(export_dir)
    manifest = read_manifest(export_dir)
    stamp = os.stat(os.path.join(export_dir, "manifest.json")).st_mtime_ns  # which export the store is of
    target = point_store_dir(export_dir)
    if os.path.exists(os.path.join(target, "meta.json")) and not rebuild:
        meta = read_meta(target)
        same = meta["rows"] == manifest["rows"] and meta["dim"] == manifest["dim"]
        if same and meta.get("manifest_mtime_ns") == stamp:
            return target
    dim, n = int(manifest["dim"]), int(manifest["rows"])
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
            padded = np.zeros((keys.size, stride // 4), np.float32)
            padded[:, :dim] = w
            fk.write(keys.tobytes())
            fr.write(padded.tobytes())
            written += keys.size
            last = keys[-1] if keys.size else last
        tail = (-(written * stride)) % BLOCK_BYTES
        fr.write(b"\0" * tail)
    if written != n:
        raise ServingError(f"{export_dir}: {written} rows in the files, the manifest says {n}")
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(
            {"format": FORMAT, "version": VERSION, "dim": dim, "rows": n, "stride": stride, "manifest_mtime_ns": stamp},
            f,
        )
    if os.path.exists(target):
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another builder's store landed first: keep it
        shutil.rmtree(tmp, ignore_errors=True)
    return target
