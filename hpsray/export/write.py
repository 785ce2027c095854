"""Writing an export: rows to Parquet sorted by key, dense weights to ``dense.pt``, the
``manifest.json`` last and atomically; ``incremental`` adds a delta of the rows that changed
(docs/export.md)."""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hpsray.errors import ExportError
from hpsray.export.layout import ExportLayout
from hpsray.export.read import (
    DELTA_DIR,
    DELTA_FORMAT,
    DELTA_VERSION,
    FORMAT,
    MANIFEST,
    VERSION,
    base_id,
    delta_chain,
    model_state,
    read_manifest,
)
from hpsray.export.remote import fetch_export, is_uri, local_files, upload_export
from hpsray.fileio import fsync_dir, write_json
from hpsray.first_order import needs_first_order
from hpsray.models.kinds import model_spec
from hpsray.tables import with_first_order

DEFAULT_ROWS_PER_FILE = 1_000_000

if TYPE_CHECKING:
    from hpsray.config import TrainConfig


def _fixed_list(values: np.ndarray, width: int) -> Any:
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, width)


def schema_of_source(source: Any) -> Any:
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


def input_spec(schema: Any) -> dict:
    """What serving needs to turn one example's raw values into a model input.

    ``{"dense": [names], "categorical": [names], "encoding", "multi_hot_separator",
    "dense_transform"}``: categorical slot ``i`` is ``categorical[i]``; columns given by position
    in a headerless file are named as :meth:`~hpsray.data.Schema.column_names` names them.
    """
    names = schema.known_column_names()

    def name(c: str | int) -> str:
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


def _export_to_uri(pipeline_or_rows: Any, uri: str, config: TrainConfig, incremental: bool, **kw: Any) -> dict:
    """:func:`export` to ``uri``: into a local directory (holding the export there first, for a
    delta), then uploaded; returns the manifest."""
    import tempfile

    local = tempfile.mkdtemp(prefix="hpsray-export-")
    try:
        unchanged = None
        if incremental:
            try:
                unchanged = local_files(fetch_export(uri, local))
            except ExportError:
                pass  # no export there yet: a full one
        manifest = export(pipeline_or_rows, local, config, incremental=incremental, **kw)
        upload_export(local, uri, unchanged)
        return manifest
    finally:
        shutil.rmtree(local, ignore_errors=True)


def export(
    pipeline_or_rows: Any,
    directory: str | os.PathLike,
    config: TrainConfig,
    *,
    n_slots: int | None = None,
    n_dense: int | None = None,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    extra: Mapping[str, Any] | None = None,
    schema: Any = None,
    incremental: bool = False,
) -> dict:
    """Write a trained model to ``directory``; returns the manifest (of the delta, when one is written).

    Args:
        pipeline_or_rows: a fitted :class:`~hpsray.pipelines.Pipeline` (its
            :meth:`~hpsray.pipelines.Pipeline.export_rows` and ``dense_state()`` are written), or
            a tuple ``(keys uint64[n], rows float32[n, width], dense_state)`` such as
            :meth:`hpsray.reference.ReferenceTrainer.export` returns.
        directory: a local directory, created if needed; an earlier export there is replaced;
            or an object-storage URI (``s3://bucket/model``: written locally, then uploaded).
        config: the :class:`~hpsray.config.TrainConfig` the rows were trained with (gives dim,
            optimizer and therefore the split of each row into weights and state).
        n_slots, n_dense: the model's input shape, recorded in the manifest (taken from the
            pipeline's source when not given).
        rows_per_file: rows per Parquet file.
        extra: more JSON-able entries for the manifest (e.g. ``{"trainer": "reference"}``).
        schema: the :class:`~hpsray.data.Schema` of the training data (taken from the pipeline's
            source when not given); recorded as ``schema`` and ``input`` so that the model can be
            served from raw values (docs/serving.md). Without one the manifest has neither.
        incremental: when ``directory`` already holds an export, write a delta beside it
            (``delta-NNNNNN/``, see :func:`export_delta`) instead of replacing it; without one,
            a full export. ``n_slots``, ``n_dense``, ``schema`` stay the base export's.
    """
    import torch

    if rows_per_file < 1:
        raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
    if is_uri(directory):  # object storage: written here, then uploaded (export/remote.py)
        return _export_to_uri(
            pipeline_or_rows,
            os.fspath(directory),
            config,
            n_slots=n_slots,
            n_dense=n_dense,
            rows_per_file=rows_per_file,
            extra=extra,
            schema=schema,
            incremental=incremental,
        )
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
    if n_slots is not None:
        config = with_first_order(config, n_slots)  # a model of first-order rows: their table (hpsray.first_order)
    elif needs_first_order(config):
        raise ValueError(
            f"export: a {config.model_kind} model's first-order rows need n_slots (the source's, or given)"
        )
    dim, width = config.row_dim, config.row_width
    if rows.ndim != 2 or rows.shape != (keys.size, width):
        raise ValueError(
            f"export: expected rows float32[{keys.size}, {width}] (dim {dim} + optimizer state), got {rows.shape}"
        )
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    if keys.size > 1 and np.any(keys[1:] == keys[:-1]):
        raise ValueError("export: duplicate keys among the rows")
    layout = ExportLayout.of(config)  # tables of several layouts: each row's weights and state apart
    if layout is not None:
        rows, dim, width = layout.to_export(keys, rows), layout.dim, layout.dim + layout.state_width

    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, MANIFEST)
    if incremental and os.path.exists(manifest_path):
        return export_delta(
            directory, keys, rows, dense, config, rows_per_file=rows_per_file, extra=extra, laid_out=True
        )
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the directory is not a valid export until the new manifest lands
    for old in glob.glob(os.path.join(directory, "rows-*.parquet")):
        os.remove(old)
    for name in os.listdir(directory):  # the old export's deltas
        if DELTA_DIR.fullmatch(name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    shutil.rmtree(os.path.join(directory, "point"), ignore_errors=True)  # serving's layout of the old rows

    files = _write_rows(directory, keys, rows, dim, rows_per_file, "rows", at_least_one=True)
    torch.save({k: v.detach().cpu() for k, v in dense.items()}, os.path.join(directory, "dense.pt"))

    state_width = width - dim
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "export_id": uuid.uuid4().hex,
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
        "model": {**model_spec(config).to_dict(), "n_slots": n_slots, "n_dense": n_dense},
        "init_scale": config.init_scale,
        "seed": config.seed,
        "minibatch_size": config.minibatch_size,
        **({"schema": schema.to_dict(), "input": input_spec(schema)} if schema is not None else {}),
        **({"tables": _tables(config, n_slots)} if config.tables else {}),
        **dict(extra or {}),
    }
    write_json(manifest_path, manifest)
    return manifest


def _tables(config: TrainConfig, n_slots: int | None) -> list[dict]:
    """The manifest's ``tables``: how serving tags a request's keys and pools its slots."""
    if n_slots is None:
        raise ValueError("export: a model of several tables needs n_slots (the source's, or given)")
    return config.tables_for(n_slots).manifest()


def _write_rows(
    directory: str,
    keys: np.ndarray,
    rows: np.ndarray | None,
    dim: int,
    rows_per_file: int,
    prefix: str,
    at_least_one: bool,
) -> list[dict]:
    """Write sorted ``keys`` and their ``rows`` (none: keys only) to ``prefix-NNNNN.parquet``
    files of at most ``rows_per_file`` rows; returns their manifest entries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    n_files = -(-keys.size // rows_per_file)
    for i in range(max(n_files, 1 if at_least_one else 0)):
        lo, hi = i * rows_per_file, min(keys.size, (i + 1) * rows_per_file)
        cols = {"key": pa.array(keys[lo:hi], type=pa.uint64())}
        if rows is not None:
            cols["weights"] = _fixed_list(rows[lo:hi, :dim], dim)
            if rows.shape[1] > dim:
                cols["state"] = _fixed_list(rows[lo:hi, dim:], rows.shape[1] - dim)
        name = f"{prefix}-{i:05d}.parquet"
        pq.write_table(pa.table(cols), os.path.join(directory, name))
        files.append({"path": name, "rows": int(hi - lo)})
    return files


def export_delta(
    directory: str | os.PathLike,
    keys: np.ndarray,
    rows: np.ndarray,
    dense: Mapping[str, Any],
    config: TrainConfig,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    extra: Mapping[str, Any] | None = None,
    laid_out: bool = False,
) -> dict:
    """Write the model ``(keys, rows, dense)`` as the next delta of the export in ``directory``;
    returns the delta's manifest. :func:`load_export` of ``directory`` then returns exactly
    ``(keys, rows, dense)`` (sorted by key; with tables of several layouts, the rows as the
    export lays them out, :mod:`~hpsray.export.layout`; ``laid_out``: ``rows`` are so already).

    The delta ``delta-NNNNNN/`` (one more than the last delta :func:`load_export` applies; any
    directory at or after that number, e.g. an interrupted delta, is removed first) holds the
    rows whose values differ bit for bit from the current state (base plus deltas) or are new,
    the keys no longer present, and the whole dense model; its ``manifest.json`` comes last.
    Cost: the current state is read whole (every row file of the base and of the deltas) and
    compared in memory: about twice the rows' bytes of memory and one sort; the rows written are
    only the changed ones. Raises :class:`~hpsray.errors.ExportError` when ``config`` gives rows of
    another shape than the base export's.
    """
    import torch

    directory = os.fspath(directory)
    base = read_manifest(directory)
    dim, width = config.row_dim, config.row_width
    layout = ExportLayout.of(config)
    if layout is not None:  # tables of several layouts: each row's weights and state apart
        dim, width = layout.dim, layout.dim + layout.state_width
        if not laid_out:
            rows = layout.to_export(np.asarray(keys, dtype=np.uint64), np.asarray(rows, dtype=np.float32))
    if (int(base["dim"]), int(base["row_width"])) != (dim, width):
        raise ExportError(
            f"{os.path.join(directory, MANIFEST)}: rows of dim {base['dim']} and width {base['row_width']}; "
            f"an incremental export of dim {dim} and width {width} cannot go on top of it"
        )
    keys = np.asarray(keys, dtype=np.uint64)
    rows = np.asarray(rows, dtype=np.float32)
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    chain = delta_chain(directory, base)
    prev_keys, prev_rows, _ = model_state(directory, base, chain)
    changed, removed = _diff(prev_keys, prev_rows, keys, rows)
    seq = (chain[-1][0] if chain else 0) + 1
    for name in os.listdir(directory):  # interrupted or orphaned deltas at or after this one
        m = DELTA_DIR.fullmatch(name)
        if m is not None and int(m.group(1)) >= seq:
            shutil.rmtree(os.path.join(directory, name))
    target = os.path.join(directory, f"delta-{seq:06d}")
    os.makedirs(target)
    files = _write_rows(target, keys[changed], rows[changed], dim, rows_per_file, "rows", at_least_one=False)
    removed_files = _write_rows(target, removed, None, dim, rows_per_file, "removed", at_least_one=False)
    torch.save({k: v.detach().cpu() for k, v in dense.items()}, os.path.join(target, "dense.pt"))
    manifest = {
        "format": DELTA_FORMAT,
        "version": DELTA_VERSION,
        "base": base_id(base),
        "sequence": seq,
        "dim": dim,
        "state_width": width - dim,
        "row_width": width,
        "rows": int(keys.size),
        "changed": int(np.count_nonzero(changed)),
        "removed": int(removed.size),
        "files": files,
        "removed_files": removed_files,
        "dense": "dense.pt",
        **dict(extra or {}),
    }
    write_json(os.path.join(target, MANIFEST), manifest)
    fsync_dir(target)
    fsync_dir(directory)
    return manifest


def _diff(
    prev_keys: np.ndarray, prev_rows: np.ndarray, keys: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(changed bool[len(keys)], removed keys)`` of the sorted, unique ``keys`` against the
    sorted, unique ``prev_keys``: new keys and keys whose row differs in any bit are changed."""
    changed = np.ones(keys.size, dtype=bool)
    _, ip, i = np.intersect1d(prev_keys, keys, assume_unique=True, return_indices=True)
    same = np.all(prev_rows[ip].view(np.uint32) == rows[i].view(np.uint32), axis=1)
    changed[i[same]] = False
    removed = prev_keys[~np.isin(prev_keys, keys, assume_unique=True)]
    return changed, removed
