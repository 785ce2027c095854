"""Writing a :class:`PlantedCTR` stream as a click log on disk (``hpsray gen-data``).

Each row holds the label, the dense features and, per slot, the *raw* categorical value: the
Zipf rank ``r`` of each key, as lowercase hex text in Criteo TSV (several values of a multi-hot
slot joined by ``,``) or as an ``int64`` (``list<int64>`` for multi-hot slots) in Parquet.
Reading the files back with the schema written beside them (``_schema.toml``) gives exactly the
keys ``hash_keys(slot, r)`` that ``PlantedCTR`` produces in memory, the same dense values (float32
text is written in its shortest round-trip form) and the same labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from hpsray.data.schema import Schema
from hpsray.data.sources import resolve_filesystem
from hpsray.data.synthetic import BLOCK_ROWS, PlantedCTR

SCHEMA_FILE = "_schema.toml"
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@nb.njit(cache=True)
def _hex_len(v):
    n = 1
    while v >= np.uint64(16):
        v >>= np.uint64(4)
        n += 1
    return n


@nb.njit(cache=True)
def _format_hex_slot(ranks, per_example, start, width, n, hexchars):
    """Text of one slot for ``n`` examples: ``width`` hex values joined by ``,``."""
    offsets = np.empty(n + 1, np.int32)
    offsets[0] = 0
    total = 0
    for i in range(n):
        base = i * per_example + start
        ln = width - 1
        for j in range(width):
            ln += _hex_len(ranks[base + j])
        total += ln
        offsets[i + 1] = total
    data = np.empty(total, np.uint8)
    for i in range(n):
        base = i * per_example + start
        p = offsets[i]
        for j in range(width):
            if j:
                data[p] = 44  # ','
                p += 1
            v = ranks[base + j]
            ln = _hex_len(v)
            for k in range(ln - 1, -1, -1):
                data[p + k] = hexchars[v & np.uint64(15)]
                v >>= np.uint64(4)
            p += ln
    return offsets, data


def dense_names(n: int) -> list[str]:
    return [f"I{i + 1}" for i in range(n)]


def slot_names(n: int) -> list[str]:
    return [f"C{i + 1}" for i in range(n)]


def dataset_schema(gen: PlantedCTR, format: str) -> Schema:
    """The schema under which the files written for ``gen`` read back exactly."""
    multi = bool((gen.slot_nnz > 1).any())
    if format == "criteo":
        return Schema.criteo(gen.n_dense, gen.n_slots, dense_transform="none", multi_hot_separator="," if multi else "")
    if format == "parquet":
        return Schema(
            format="parquet",
            label="label",
            dense=tuple(dense_names(gen.n_dense)),
            categorical=tuple(slot_names(gen.n_slots)),
        )
    raise ValueError(f"format must be 'criteo' or 'parquet', got {format!r}")


def _table(gen: PlantedCTR, batch: Any, ranks: np.ndarray, format: str) -> pa.Table:
    n = len(batch)
    m = gen.slot_nnz
    per_example = int(m.sum())
    starts = np.concatenate([[0], np.cumsum(m)[:-1]])
    cols: dict[str, pa.Array] = {"label": pa.array(batch.labels.astype(np.int8))}
    for j, name in enumerate(dense_names(gen.n_dense)):
        cols[name] = pa.array(batch.dense[:, j])
    r2 = ranks.reshape(n, per_example) if n else ranks.reshape(0, per_example)
    for s, name in enumerate(slot_names(gen.n_slots)):
        width, start = int(m[s]), int(starts[s])
        if format == "criteo":
            offs, data = _format_hex_slot(ranks, per_example, start, width, n, _HEX)
            cols[name] = pa.StringArray.from_buffers(n, pa.py_buffer(offs), pa.py_buffer(data))
        elif width == 1:
            cols[name] = pa.array(r2[:, start].astype(np.int64))
        else:
            flat = pa.array(np.ascontiguousarray(r2[:, start : start + width]).reshape(-1).astype(np.int64))
            cols[name] = pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), flat)
    return pa.table(cols)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t").replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document of flat tables (enough for ``_schema.toml``)."""
    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def write_synthetic(
    out: str,
    gen: PlantedCTR,
    rows: int,
    format: str = "criteo",
    *,
    shard_rows: int = 1_000_000,
    compression: str = "none",
    row_group_rows: int = 65536,
    progress: Callable[[int, int, str], None] | None = None,
    filesystem: Any = None,
) -> list[str]:
    """Write rows ``0..rows-1`` of ``gen`` to ``out`` (a directory on any pyarrow/fsspec filesystem).

    Shards hold ``shard_rows`` rows each: ``part-00000.tsv`` (``.gz``/``.zst`` with
    ``compression``) or ``part-00000.parquet`` (``compression`` is then the Parquet codec,
    ``none`` meaning snappy). ``_schema.toml`` beside them holds the ``[schema]`` to read them
    with and the ``[generator]`` parameters. ``progress(rows_done, rows, file)`` is called after
    each chunk. Returns the shard paths.
    """
    if rows < 0 or shard_rows < 1:
        raise ValueError(f"need rows >= 0 and shard_rows >= 1, got {rows}, {shard_rows}")
    schema = dataset_schema(gen, format)
    fs, root, prefix = resolve_filesystem(out, filesystem)
    fs.create_dir(root, recursive=True)
    ext = {"none": "", "gzip": ".gz", "zstd": ".zst", "bz2": ".bz2"}
    if format == "criteo" and compression not in ext:
        raise ValueError(f"compression must be one of {', '.join(ext)}, got {compression!r}")
    written: list[str] = []
    done = 0
    for shard in range(max(1, -(-rows // shard_rows))):
        n_shard = min(shard_rows, rows - done)
        if format == "criteo":
            name = f"part-{shard:05d}.tsv{ext[compression]}"
        else:
            name = f"part-{shard:05d}.parquet"
        path = f"{root.rstrip('/')}/{name}"
        with fs.open_output_stream(path, compression=None) as raw:
            sink = pa.CompressedOutputStream(raw, compression) if format == "criteo" and compression != "none" else raw
            writer = None
            row, end = done, done + n_shard
            while row < end:
                blk, ranks = gen.raw_block(row // BLOCK_ROWS)
                lo = row % BLOCK_ROWS
                hi = min(BLOCK_ROWS, lo + end - row)
                piece = blk.slice(lo, hi)
                per = gen.nnz_per_example
                table = _table(gen, piece, ranks[lo * per : hi * per], format)
                if format == "criteo":
                    pcsv.write_csv(
                        table, sink, pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
                    )
                else:
                    if writer is None:
                        codec = "snappy" if compression == "none" else compression
                        writer = pq.ParquetWriter(sink, table.schema, compression=codec)
                    writer.write_table(table, row_group_size=row_group_rows)
                row += hi - lo
                if progress:
                    progress(row, rows, prefix + path)
            if writer is not None:
                writer.close()
            elif format == "parquet":  # zero rows: still a valid (empty) Parquet file
                pq.write_table(_table(gen, gen.block(0).slice(0, 0), np.zeros(0, np.uint64), format), sink)
            if sink is not raw:
                sink.close()
        written.append(prefix + path)
        done += n_shard
    meta = {
        "schema": schema.to_dict(),
        "generator": {
            "rows": rows,
            "n_slots": gen.n_slots,
            "keys_per_slot": gen.keys_per_slot,
            "nnz_per_slot": list(gen.slot_nnz),
            "n_dense": gen.n_dense,
            "zipf_a": gen.zipf_a,
            "key_scale": gen.key_scale,
            "dense_scale": gen.dense_scale,
            "bias": gen.bias,
            "seed": gen.seed,
        },
    }
    with fs.open_output_stream(f"{root.rstrip('/')}/{SCHEMA_FILE}", compression=None) as f:
        f.write(to_toml(meta).encode())
    return written


def load_dataset(directory: str) -> tuple[Schema, PlantedCTR | None]:
    """The schema (and the generator, when written by :func:`write_synthetic`) of a data directory."""
    import tomllib

    fs, root, _ = resolve_filesystem(directory)
    with fs.open_input_stream(f"{root.rstrip('/')}/{SCHEMA_FILE}", compression=None) as f:
        meta = tomllib.loads(f.read().decode())
    schema = Schema.from_dict(meta.get("schema", {}), where=f"{SCHEMA_FILE}: schema")
    g = meta.get("generator")
    gen = None
    if g:
        g = {k: v for k, v in g.items() if k != "rows"}
        nnz = g.pop("nnz_per_slot")
        gen = PlantedCTR(nnz_per_slot=nnz[0] if len(set(nnz)) == 1 else tuple(nnz), **g)
    return schema, gen
