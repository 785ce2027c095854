"""Exporting a trained model: rows to Parquet, dense weights to ``dense.pt``, a ``manifest.json``.

The format is documented in ``docs/export.md``. In short, a directory holding::

    manifest.json          format, version, export id, dim, state width, optimizer, model shape,
                           files, the data schema and serving inputs (raw values -> keys)
    rows-00000.parquet     key: uint64, weights: fixed_size_list<float32>[dim],
    rows-00001.parquet       state: fixed_size_list<float32>[state_width] (absent when 0)
    dense.pt               torch.save(state_dict) of the dense model
    delta-000001/          incremental exports on top of it (``export(..., incremental=True)``):
        manifest.json        format hpsray-export-delta, base export id, sequence, counts, files
        rows-00000.parquet   the rows whose values changed since the previous state (or are new)
        removed-00000.parquet  keys no longer present (only when some are)
        dense.pt             the whole dense model

Rows are written sorted by key. A ``manifest.json`` is written last, atomically, so a directory
(or delta directory) without it is an interrupted export. :func:`load_export` applies the deltas
in order, stopping (with a warning) at the first interrupted or foreign one.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from hpsray.errors import ExportError
from hpsray.fileio import fsync_dir

FORMAT = "hpsray-export"
VERSION = 1
DELTA_FORMAT = "hpsray-export-delta"
DELTA_VERSION = 1
DEFAULT_ROWS_PER_FILE = 1_000_000
MANIFEST = "manifest.json"

log = logging.getLogger("hpsray.export")
_DELTA_DIR = re.compile(r"delta-(\d{6,})")


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
    incremental: bool = False,
) -> dict:
    """Write a trained model to ``directory``; returns the manifest (of the delta, when one is written).

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
        incremental: when ``directory`` already holds an export, write a delta beside it
            (``delta-NNNNNN/``, see :func:`export_delta`) instead of replacing it; without one,
            a full export. ``n_slots``, ``n_dense``, ``schema`` stay the base export's.
    """
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
    manifest_path = os.path.join(directory, MANIFEST)
    if incremental and os.path.exists(manifest_path):
        return export_delta(directory, keys, rows, dense, config, rows_per_file=rows_per_file, extra=extra)
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the directory is not a valid export until the new manifest lands
    for old in glob.glob(os.path.join(directory, "rows-*.parquet")):
        os.remove(old)
    for name in os.listdir(directory):  # the old export's deltas
        if _DELTA_DIR.fullmatch(name):
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
        "model": {"hidden": list(config.hidden), "n_slots": n_slots, "n_dense": n_dense},
        "init_scale": config.init_scale,
        "seed": config.seed,
        "minibatch_size": config.minibatch_size,
        **({"schema": schema.to_dict(), "input": input_spec(schema)} if schema is not None else {}),
        **dict(extra or {}),
    }
    _write_manifest(manifest_path, manifest)
    return manifest


def _write_manifest(path: str, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest`` as JSON under a temporary name, fsync, rename over ``path``."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def _base_id(manifest: Mapping[str, Any]) -> str:
    """The identity of a full export that its deltas record: its ``export_id`` (exports written
    before deltas existed: a digest of their manifest)."""
    if "export_id" in manifest:
        return str(manifest["export_id"])
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]


def export_delta(
    directory: str | os.PathLike,
    keys: np.ndarray,
    rows: np.ndarray,
    dense: Mapping[str, Any],
    config,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    extra: Mapping[str, Any] | None = None,
) -> dict:
    """Write the model ``(keys, rows, dense)`` as the next delta of the export in ``directory``;
    returns the delta's manifest. :func:`load_export` of ``directory`` then returns exactly
    ``(keys, rows, dense)`` (sorted by key).

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
    dim, width = config.dim, config.row_width
    if (int(base["dim"]), int(base["row_width"])) != (dim, width):
        raise ExportError(
            f"{os.path.join(directory, MANIFEST)}: rows of dim {base['dim']} and width {base['row_width']}; "
            f"an incremental export of dim {dim} and width {width} cannot go on top of it"
        )
    keys = np.asarray(keys, dtype=np.uint64)
    rows = np.asarray(rows, dtype=np.float32)
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    chain = _delta_chain(directory, base)
    prev_keys, prev_rows, _ = _state(directory, base, chain)
    changed, removed = _diff(prev_keys, prev_rows, keys, rows)
    seq = (chain[-1][0] if chain else 0) + 1
    for name in os.listdir(directory):  # interrupted or orphaned deltas at or after this one
        m = _DELTA_DIR.fullmatch(name)
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
        "base": _base_id(base),
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
    _write_manifest(os.path.join(target, MANIFEST), manifest)
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


def _read_delta_manifest(path: str) -> dict | str:
    """A delta directory's checked manifest, or the reason it cannot be applied."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            m = json.load(f)
    except FileNotFoundError:
        return f"{mpath}: missing (an interrupted incremental export)"
    except (OSError, ValueError) as e:
        return f"{mpath}: unreadable: {e}"
    if not isinstance(m, dict) or m.get("format") != DELTA_FORMAT or m.get("version") != DELTA_VERSION:
        return f"{mpath}: not a {DELTA_FORMAT} version {DELTA_VERSION}"
    return m


def _delta_chain(directory: str, base: Mapping[str, Any]) -> list[tuple[int, str, dict]]:
    """The deltas of ``directory`` that apply to ``base``, in order: ``(sequence, path, manifest)``
    for ``delta-000001``, ``delta-000002``, ... up to the first one missing, interrupted (no
    manifest), damaged or of another base export; that one and every later one are ignored,
    each with a warning."""
    found = sorted(
        (int(m.group(1)), os.path.join(directory, name))
        for name in os.listdir(directory)
        if (m := _DELTA_DIR.fullmatch(name)) is not None and os.path.isdir(os.path.join(directory, name))
    )
    chain: list[tuple[int, str, dict]] = []
    base_id = _base_id(base)
    for k, (seq, path) in enumerate(found):
        m = _read_delta_manifest(path)
        reason = m if isinstance(m, str) else None
        if reason is None and seq != len(chain) + 1:
            reason = f"{path}: delta {seq} follows delta {len(chain)}: the deltas between are missing"
        if reason is None and isinstance(m, dict) and (m.get("base") != base_id or m.get("sequence") != seq):
            reason = f"{path}: a delta of another export (base {m.get('base')!r}, this export is {base_id!r})"
        if reason is not None or not isinstance(m, dict):
            later = [p for _, p in found[k + 1 :]]
            log.warning(
                "export %s: ignoring %s%s", directory, reason, f" and the deltas after it: {later}" if later else ""
            )
            break
        chain.append((seq, path, m))
    return chain


def export_chain(directory: str | os.PathLike) -> list[str]:
    """The directories whose manifests make up the export in ``directory``, in the order
    :func:`load_export` applies them: ``directory`` itself, then each delta that applies.
    The last one's ``manifest.json`` changes whenever a new export or delta lands."""
    directory = os.fspath(directory)
    return [directory] + [path for _, path, _ in _delta_chain(directory, read_manifest(directory))]


def read_manifest(directory: str | os.PathLike) -> dict:
    """The checked ``manifest.json`` of an export directory."""
    path = os.path.join(os.fspath(directory), MANIFEST)
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


def _read_rows(directory: str, files: list[dict], dim: int, state_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and rows (weights, then state; ``dim == 0``: keys only) of Parquet files ``files``."""
    import pyarrow.parquet as pq

    keys, rows = [], []
    for entry in files:
        path = os.path.join(directory, entry["path"])
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise ExportError(f"{path}: cannot read: {e}") from None
        if len(table) != entry["rows"]:
            raise ExportError(f"{path}: {len(table)} rows, the manifest says {entry['rows']}")
        keys.append(table.column("key").to_numpy().astype(np.uint64, copy=False))
        if dim:
            parts = [_column(table, "weights", dim, path)]
            if state_width:
                parts.append(_column(table, "state", state_width, path))
            rows.append(np.hstack(parts) if len(parts) > 1 else parts[0])
    k = np.concatenate(keys) if keys else np.empty(0, np.uint64)
    r = np.concatenate(rows) if rows else np.empty((0, dim + state_width), np.float32)
    return k, r


def _apply_delta(
    keys: np.ndarray, rows: np.ndarray, dkeys: np.ndarray, drows: np.ndarray, removed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The sorted state after a delta: ``removed`` keys gone, ``dkeys`` set to ``drows``."""
    keep = ~np.isin(keys, np.concatenate([removed, dkeys]))
    keys, rows = np.concatenate([keys[keep], dkeys]), np.concatenate([rows[keep], drows])
    order = np.argsort(keys, kind="stable")
    return keys[order], rows[order]


def load_export(directory: str | os.PathLike, *, deltas: bool = True) -> tuple[np.ndarray, np.ndarray, dict]:
    """Read an export back: ``(keys uint64[n] sorted, rows float32[n, dim + state_width], dense_state)``.

    The rows have the layout the trainers use (weights, then optimizer state), so they compare
    directly with :meth:`~hpsray.pipelines.Pipeline.export_rows`. The deltas that apply (see
    :func:`export_chain`; an interrupted one, and any after it, is ignored with a warning) are
    applied in order, and the dense state is the last one's; ``deltas=False`` reads the full
    export alone.
    """
    import torch

    directory = os.fspath(directory)
    m = read_manifest(directory)
    keys, rows, dense_path = _state(directory, m, _delta_chain(directory, m) if deltas else [])
    return keys, rows, torch.load(dense_path, map_location="cpu", weights_only=True)


def _state(
    directory: str, m: Mapping[str, Any], chain: list[tuple[int, str, dict]]
) -> tuple[np.ndarray, np.ndarray, str]:
    """Keys and rows of the export ``directory`` (manifest ``m``) with the deltas of ``chain``
    applied, and the path of the dense state that goes with them."""
    dim, state_width = int(m["dim"]), int(m["state_width"])
    k, r = _read_rows(directory, m["files"], dim, state_width)
    if k.size != m["rows"]:
        raise ExportError(f"{directory}: {k.size} rows in the files, the manifest says {m['rows']}")
    dense_path = os.path.join(directory, m["dense"])
    for _, path, dm in chain:
        dk, dr = _read_rows(path, dm["files"], dim, state_width)
        removed, _ = _read_rows(path, dm["removed_files"], 0, 0)
        k, r = _apply_delta(k, r, dk, dr, removed)
        if k.size != dm["rows"]:
            raise ExportError(f"{path}: {k.size} rows after applying it, its manifest says {dm['rows']}")
        dense_path = os.path.join(path, dm["dense"])
    return k, r, dense_path


def compare_exports(a: tuple[np.ndarray, np.ndarray, Mapping], b: tuple[np.ndarray, np.ndarray, Mapping]) -> dict:
    """How far two trained models are apart, order-insensitively.

    Returns ``rows_a``, ``rows_b``, ``keys_only_in_a``, ``keys_only_in_b``, ``max_abs_row_diff``
    (over the common keys, weights and state) and ``max_abs_dense_diff`` (``inf`` when the dense
    parameters differ in names or shapes); and where they differ: ``rows_differing`` (common
    keys whose rows are not bit-equal), ``max_rel_diff`` (the largest ``|a - b| / max(|a|, |b|)``,
    rows and dense) and ``max_ulps`` (the largest distance in float32 units in the last place),
    so a difference of rounding's size (a few ulps) tells itself from a real one.
    """
    ka, ra, da = a
    kb, rb, db = b
    oa, ob = np.argsort(ka), np.argsort(kb)
    ka, ra, kb, rb = ka[oa], ra[oa], kb[ob], rb[ob]
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    if ra.shape[1:] != rb.shape[1:]:
        row_diff, rows_differing = float("inf"), int(common.size)
    else:
        pairs.append((ra[ia], rb[ib]))
        row_diff = float(np.max(np.abs(ra[ia] - rb[ib]))) if common.size else 0.0
        rows_differing = int(np.count_nonzero(np.any(ra[ia] != rb[ib], axis=1))) if common.size else 0
    if set(da) != set(db) or any(tuple(da[n].shape) != tuple(db[n].shape) for n in da):
        dense_diff = float("inf")
    else:
        dense_diff = max((float((da[n].float() - db[n].float()).abs().max()) for n in da if da[n].numel()), default=0.0)
        pairs += [(da[n].float().numpy().ravel(), db[n].float().numpy().ravel()) for n in da if da[n].numel()]
    rel, ulps = 0.0, 0
    for x, y in pairs:
        x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
        if x.size:
            scale = np.maximum(np.abs(x), np.abs(y))
            with np.errstate(invalid="ignore", divide="ignore"):
                r = np.where(scale > 0, np.abs(x - y) / scale, 0.0)
            rel = max(rel, float(np.nanmax(r)))
            ulps = max(ulps, int(np.max(np.abs(_ordered_bits(x) - _ordered_bits(y)))))
    if not pairs and (row_diff == float("inf") or dense_diff == float("inf")):
        rel, ulps = float("inf"), -1
    return {
        "rows_a": int(ka.size),
        "rows_b": int(kb.size),
        "keys_only_in_a": int(ka.size - common.size),
        "keys_only_in_b": int(kb.size - common.size),
        "max_abs_row_diff": row_diff,
        "max_abs_dense_diff": dense_diff,
        "rows_differing": rows_differing,
        "max_rel_diff": rel,
        "max_ulps": ulps,
    }


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as int64 integers in the floats' order, one apart for neighbouring floats
    (``-0.0`` and ``0.0`` both 0): distances are in units in the last place."""
    bits = x.view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
