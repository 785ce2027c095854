"""Exporting a trained model: rows to Parquet, dense weights to ``dense.pt``, a ``manifest.json``.

The format is documented in ``docs/export.md``. In short, a directory holding::

    manifest.json          format, version, dim, state width, optimizer, model shape, files,
                           the data schema and serving inputs (raw values -> keys)
    rows-00000.parquet     key: uint64, weights: fixed_size_list<float32>[dim],
    rows-00001.parquet       state: fixed_size_list<float32>[state_width] (absent when 0)
    dense.pt               torch.save(state_dict) of the dense model

Rows are written sorted by key. ``manifest.json`` is written last, atomically, so a directory
without it is an interrupted export.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from hpsray.errors import ExportError

FORMAT = "hpsray-export"
VERSION = 1
DEFAULT_ROWS_PER_FILE = 1_000_000


def _fixed_list(values: np.ndarray, width: int):
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, width)


def schema_of_source(source: Any):
    """The :class:`~hpsray.data.Schema` under which ``source``'s raw values become its keys.

    A :class:`~hpsray.pipelines.FileSource` has its declared schema; a
    :class:`~hpsray.pipelines.SyntheticSource` the Parquet layout ``hpsray gen-data`` writes for it
    (integer columns ``C1..Cn`` holding a key's Zipf rank, dense ``I1..Im``). ``None`` otherwise.
    """
    schema = getattr(source, "schema", None)
    if schema is not None:
        return schema
    generator = getattr(source, "generator", None)
    if generator is not None:
        from hpsray.data.generate import dataset_schema

        return dataset_schema(generator, "parquet")
    return None


def input_spec(schema) -> dict:
    """What serving needs to turn one example's raw values into a model input.

    ``{"dense": [names], "categorical": [names], "encoding", "multi_hot_separator",
    "dense_transform"}``: categorical slot ``i`` is ``categorical[i]``; columns given by position
    in a headerless file are named as :meth:`~hpsray.data.Schema.column_names` names them.
    """
    names = schema.column_names() if schema.is_text and not schema.header else None

    def name(c) -> str:
        if isinstance(c, str):
            return c
        return names[c] if names is not None and c < len(names) else f"c{c}"

    return {
        "dense": [name(c) for c in schema.dense],
        "categorical": [name(c) for c in schema.categorical],
        "encoding": schema.encoding,
        "multi_hot_separator": schema.multi_hot_separator,
        "dense_transform": schema.dense_transform,
    }


def export(
    pipeline_or_rows: Any,
    directory: str | os.PathLike,
    config,
    *,
    n_slots: int | None = None,
    n_dense: int | None = None,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    extra: Mapping[str, Any] | None = None,
    schema: Any = None,
) -> dict:
    """Write a trained model to ``directory``; returns the manifest.

    Args:
        pipeline_or_rows: a fitted :class:`~hpsray.pipelines.Pipeline` (its
            :meth:`~hpsray.pipelines.Pipeline.export_rows` and ``dense_state()`` are written), or
            a tuple ``(keys uint64[n], rows float32[n, width], dense_state)`` such as
            :meth:`hpsray.reference.ReferenceTrainer.export` returns.
        directory: a local directory, created if needed; an earlier export there is replaced.
        config: the :class:`~hpsray.config.TrainConfig` the rows were trained with (gives dim,
            optimizer and therefore the split of each row into weights and state).
        n_slots, n_dense: the model's input shape, recorded in the manifest (taken from the
            pipeline's source when not given).
        rows_per_file: rows per Parquet file.
        extra: more JSON-able entries for the manifest (e.g. ``{"trainer": "reference"}``).
        schema: the :class:`~hpsray.data.Schema` of the training data (taken from the pipeline's
            source when not given); recorded as ``schema`` and ``input`` so that the model can be
            served from raw values (docs/serving.md). Without one the manifest has neither.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    if rows_per_file < 1:
        raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
    if isinstance(pipeline_or_rows, tuple):
        keys, rows, dense = pipeline_or_rows
    else:
        keys, rows = pipeline_or_rows.export_rows()
        dense = pipeline_or_rows.dense_state()
        source = getattr(pipeline_or_rows, "source", None)
        n_slots = n_slots if n_slots is not None else getattr(source, "n_slots", None)
        n_dense = n_dense if n_dense is not None else getattr(source, "n_dense", None)
        schema = schema if schema is not None else schema_of_source(source)
    keys = np.asarray(keys, dtype=np.uint64)
    rows = np.asarray(rows, dtype=np.float32)
    dim, width = config.dim, config.row_width
    if rows.ndim != 2 or rows.shape != (keys.size, width):
        raise ValueError(
            f"export: expected rows float32[{keys.size}, {width}] (dim {dim} + optimizer state), got {rows.shape}"
        )
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    if keys.size > 1 and np.any(keys[1:] == keys[:-1]):
        raise ValueError("export: duplicate keys among the rows")

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, "manifest.json")
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the directory is not a valid export until the new manifest lands
    for old in glob.glob(os.path.join(directory, "rows-*.parquet")):
        os.remove(old)
    shutil.rmtree(os.path.join(directory, "point"), ignore_errors=True)  # serving's layout of the old rows

    state_width = width - dim
    files = []
    n_files = max(1, -(-keys.size // rows_per_file))
    for i in range(n_files):
        lo, hi = i * rows_per_file, min(keys.size, (i + 1) * rows_per_file)
        cols = {"key": pa.array(keys[lo:hi], type=pa.uint64()), "weights": _fixed_list(rows[lo:hi, :dim], dim)}
        if state_width:
            cols["state"] = _fixed_list(rows[lo:hi, dim:], state_width)
        name = f"rows-{i:05d}.parquet"
        pq.write_table(pa.table(cols), os.path.join(directory, name))
        files.append({"path": name, "rows": int(hi - lo)})
    torch.save({k: v.detach().cpu() for k, v in dense.items()}, os.path.join(directory, "dense.pt"))

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "dim": dim,
        "state_width": state_width,
        "row_width": width,
        "rows": int(keys.size),
        "files": files,
        "dense": "dense.pt",
        "optimizer": {
            "sparse": config.sparse_optimizer,
            "sparse_lr": config.sparse_lr,
            "sparse_params": dict(config.sparse_params),
            "dense": config.dense_optimizer,
            "dense_lr": config.dense_lr,
        },
        "model": {"hidden": list(config.hidden), "n_slots": n_slots, "n_dense": n_dense},
        "init_scale": config.init_scale,
        "seed": config.seed,
        "minibatch_size": config.minibatch_size,
        **({"schema": schema.to_dict(), "input": input_spec(schema)} if schema is not None else {}),
        **dict(extra or {}),
    }
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    os.replace(tmp, manifest_path)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The checked ``manifest.json`` of an export directory."""
    path = os.path.join(os.fspath(directory), "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (not an hpsray export, or the export was interrupted)") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ExportError(f"{path}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ExportError(f"{path}: version {manifest.get('version')!r} is not supported (this reader: {VERSION})")
    return manifest


def _column(table, name: str, width: int, path: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if flat.size != len(table) * width:
        raise ExportError(f"{path}: column {name!r} holds {flat.size} values for {len(table)} rows of width {width}")
    return flat.reshape(len(table), width)


def load_export(directory: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, dict]:
    """Read an export back: ``(keys uint64[n] sorted, rows float32[n, dim + state_width], dense_state)``.

    The rows have the layout the trainers use (weights, then optimizer state), so they compare
    directly with :meth:`~hpsray.pipelines.Pipeline.export_rows`.
    """
    import pyarrow.parquet as pq
    import torch

    directory = os.fspath(directory)
    m = read_manifest(directory)
    dim, state_width = int(m["dim"]), int(m["state_width"])
    keys, rows = [], []
    for entry in m["files"]:
        path = os.path.join(directory, entry["path"])
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise ExportError(f"{path}: cannot read: {e}") from None
        if len(table) != entry["rows"]:
            raise ExportError(f"{path}: {len(table)} rows, the manifest says {entry['rows']}")
        keys.append(table.column("key").to_numpy().astype(np.uint64, copy=False))
        parts = [_column(table, "weights", dim, path)]
        if state_width:
            parts.append(_column(table, "state", state_width, path))
        rows.append(np.hstack(parts) if len(parts) > 1 else parts[0])
    k = np.concatenate(keys) if keys else np.empty(0, np.uint64)
    r = np.concatenate(rows) if rows else np.empty((0, dim + state_width), np.float32)
    if k.size != m["rows"]:
        raise ExportError(f"{directory}: {k.size} rows in the files, the manifest says {m['rows']}")
    dense = torch.load(os.path.join(directory, m["dense"]), map_location="cpu", weights_only=True)
    return k, r, dense


def compare_exports(a: tuple[np.ndarray, np.ndarray, Mapping], b: tuple[np.ndarray, np.ndarray, Mapping]) -> dict:
    """How far two trained models are apart, order-insensitively.

    Returns ``rows_a``, ``rows_b``, ``keys_only_in_a``, ``keys_only_in_b``, ``max_abs_row_diff``
    (over the common keys, weights and state) and ``max_abs_dense_diff`` (``inf`` when the dense
    parameters differ in names or shapes).
    """
    ka, ra, da = a
    kb, rb, db = b
    oa, ob = np.argsort(ka), np.argsort(kb)
    ka, ra, kb, rb = ka[oa], ra[oa], kb[ob], rb[ob]
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    if ra.shape[1:] != rb.shape[1:]:
        row_diff = float("inf")
    else:
        row_diff = float(np.max(np.abs(ra[ia] - rb[ib]))) if common.size else 0.0
    if set(da) != set(db) or any(tuple(da[n].shape) != tuple(db[n].shape) for n in da):
        dense_diff = float("inf")
    else:
        dense_diff = max((float((da[n].float() - db[n].float()).abs().max()) for n in da if da[n].numel()), default=0.0)
    return {
        "rows_a": int(ka.size),
        "rows_b": int(kb.size),
        "keys_only_in_a": int(ka.size - common.size),
        "keys_only_in_b": int(kb.size - common.size),
        "max_abs_row_diff": row_diff,
        "max_abs_dense_diff": dense_diff,
    }
