"""Reading an export back: its manifest, its chain of deltas, its rows and dense weights
(docs/export.md). A directory without ``manifest.json`` is an interrupted export; the chain stops,
with a warning, at the first interrupted or foreign delta."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from hpsray.errors import ExportError

FORMAT = "hpsray-export"
VERSION = 1
DELTA_FORMAT = "hpsray-export-delta"
DELTA_VERSION = 1
MANIFEST = "manifest.json"
DELTA_DIR = re.compile(r"delta-(\d{6,})")
log = logging.getLogger("hpsray.export")


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


def base_id(manifest: Mapping[str, Any]) -> str:
    """The identity of a full export that its deltas record: its ``export_id`` (exports written
    before deltas existed: a digest of their manifest)."""
    if "export_id" in manifest:
        return str(manifest["export_id"])
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]


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


def delta_chain(directory: str, base: Mapping[str, Any]) -> list[tuple[int, str, dict]]:
    """The deltas of ``directory`` that apply to ``base``, in order: ``(sequence, path, manifest)``
    for ``delta-000001``, ``delta-000002``, ... up to the first one missing, interrupted (no
    manifest), damaged or of another base export; that one and every later one are ignored,
    each with a warning."""
    found = sorted(
        (int(hit.group(1)), os.path.join(directory, name))
        for name in os.listdir(directory)
        if (hit := DELTA_DIR.fullmatch(name)) is not None and os.path.isdir(os.path.join(directory, name))
    )
    chain: list[tuple[int, str, dict]] = []
    identity = base_id(base)
    for k, (seq, path) in enumerate(found):
        m = _read_delta_manifest(path)
        reason = m if isinstance(m, str) else None
        if reason is None and seq != len(chain) + 1:
            reason = f"{path}: delta {seq} follows delta {len(chain)}: the deltas between are missing"
        if reason is None and isinstance(m, dict) and (m.get("base") != identity or m.get("sequence") != seq):
            reason = f"{path}: a delta of another export (base {m.get('base')!r}, this export is {identity!r})"
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
    return [directory] + [path for _, path, _ in delta_chain(directory, read_manifest(directory))]


def _column(table: Any, name: str, width: int, path: str) -> np.ndarray:
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
    keys, rows, dense_path = model_state(directory, m, delta_chain(directory, m) if deltas else [])
    return keys, rows, torch.load(dense_path, map_location="cpu", weights_only=True)


def model_state(
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
