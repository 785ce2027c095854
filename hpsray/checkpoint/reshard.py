"""Re-partitioning a checkpoint onto another number of nodes (docs/operations.md: Resuming on
another shape).

A checkpoint of ``N`` nodes holds, per node, the SSD-PS snapshot of the rows it owns
(``h(key) % N``), its trainer's state and (with admission on) its admission counts. Resuming on
``M`` nodes needs the same rows owned by ``h(key) % M``. :func:`reshard` writes that checkpoint,
of the same batch, and commits it in place of the old one (the atomic rename of
:meth:`Checkpoints.commit`), so a later resume, or a second failure, finds it in the new shape:

* rows: each old snapshot is opened through a store of links to its immutable files and scanned
  file by file; each file's rows go, by their new owner, into ``M`` new stores (buffered up to
  one parameter file's rows per new node), which are then snapshotted into the new checkpoint.
  The process holds at most one old file and ``M`` files' worth of rows: never the table.
* dense and optimizer state: the trainer state file of old node ``j % N`` becomes new node
  ``j``'s (under BSP every node's dense replica, dense optimizer and step are equal, so this is
  exact; under SSP/ASP it carries one node's replica).
* admission counts: each key's count and last batch move to the key's new owner.

Everything is written into a staging directory of the checkpoint directory: a damaged
checkpoint (a file failing its checksum while it is read), a disk that refuses the rows, or any
other failure removes it and leaves the directory exactly as it was. No Ray inside.
"""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from hpsray.checkpoint.checkpoints import Checkpoint, Checkpoints, node_dir
from hpsray.errors import CheckpointError, SSDError
from hpsray.tiers.partition import owner_of
from hpsray.tiers.ssd import SSDPS, default_rows_per_file, restore_snapshot

__all__ = ["ADMISSION", "SSD_SNAPSHOT", "TRAINER_STATE", "checkpoint_nodes", "reshard"]

SSD_SNAPSHOT = "ssd"  # a node's SSD-PS snapshot, in its node directory
TRAINER_STATE = "trainer.pt"  # a node's trainer state (dense weights, optimizers, step)
ADMISSION = "admission.npz"  # the owner's admission counts (only with admission on)


def checkpoint_nodes(checkpoint: Checkpoint) -> int:
    """The number of nodes that wrote ``checkpoint`` (its meta's ``nodes``)."""
    try:
        n = int(checkpoint.meta["nodes"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(str(checkpoint.path), "its record names no number of nodes") from None
    if n < 1:
        raise CheckpointError(str(checkpoint.path), f"its record names {n} nodes")
    return n


class _Outputs:
    """The ``M`` new stores and a buffer of rows per store (dumped one file's rows at a time)."""

    def __init__(self, stores: list[SSDPS], rows_per_file: int) -> None:
        self.stores, self.limit = stores, rows_per_file
        self.keys: list[list[np.ndarray]] = [[] for _ in stores]
        self.rows: list[list[np.ndarray]] = [[] for _ in stores]
        self.held = [0] * len(stores)
        self.moved = [0] * len(stores)

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        owner = owner_of(keys, len(self.stores))
        for j in range(len(self.stores)):
            mine = owner == j
            if mine.any():
                self.keys[j].append(keys[mine])
                self.rows[j].append(rows[mine])
                self.held[j] += int(mine.sum())
                if self.held[j] >= self.limit:
                    self.flush(j)

    def flush(self, j: int) -> None:
        if self.held[j]:
            self.stores[j].dump(np.concatenate(self.keys[j]), np.concatenate(self.rows[j]))
            self.moved[j] += self.held[j]
            self.keys[j], self.rows[j], self.held[j] = [], [], 0


def _split_admission(checkpoint: Checkpoint, old: int, new: int, staging: Path) -> bool:
    """Write each new node's admission counts (each key's counts at its new owner); ``False``
    when the checkpoint has none (admission off)."""
    paths = [checkpoint.node(i) / ADMISSION for i in range(old)]
    present = [p.exists() for p in paths]
    if not any(present):
        return False
    if not all(present):
        missing = next(i for i, p in enumerate(present) if not p)
        raise CheckpointError(str(checkpoint.path), f"node-{missing}/{ADMISSION}: missing (other nodes have theirs)")
    parts: list[dict[str, list[np.ndarray]]] = [{"keys": [], "count": [], "last": []} for _ in range(new)]
    settings = expired = totals = None
    for i, p in enumerate(paths):
        with np.load(p) as data:
            keys = data["keys"]
            owner = owner_of(keys, new) if keys.size else np.empty(0, np.int64)
            for j in range(new):
                mine = owner == j
                for name in ("keys", "count", "last"):
                    parts[j][name].append(data[name][mine])
            if i == 0:
                settings, expired = data["settings"], data["expired_through"]
                totals = np.zeros_like(data["totals"])
            totals = totals + data["totals"]  # counters: the sum lands on new node 0
    assert settings is not None and expired is not None and totals is not None
    for j in range(new):
        out = node_dir(staging, j)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / ADMISSION, "wb") as f:
            np.savez(
                f,
                keys=np.concatenate(parts[j]["keys"]),
                count=np.concatenate(parts[j]["count"]),
                last=np.concatenate(parts[j]["last"]),
                settings=settings,
                expired_through=expired,
                totals=totals if j == 0 else np.zeros_like(totals),
            )
    return True


def reshard(
    checkpoints: Checkpoints,
    checkpoint: Checkpoint,
    nodes: int,
    *,
    rows_per_file: int | None = None,
    meta: dict | None = None,
) -> Checkpoint:
    """``checkpoint`` (of ``checkpoints``) re-partitioned onto ``nodes`` nodes, committed as the
    checkpoint of the same batch in its place (see the module docstring); the checkpoint itself
    when it already has ``nodes`` nodes. ``rows_per_file``: rows per parameter file of the new
    snapshots (the store's default when ``None``); ``meta``: entries added to the new record's
    meta (its ``nodes`` is ``nodes``; ``reshaped_from`` the old count).

    Raises :class:`~hpsray.errors.CheckpointError` naming the checkpoint and the file for a
    damaged one, :class:`~hpsray.errors.CheckpointFullError` naming the directory and the bytes
    when the disk cannot hold the new copy of the rows; the directory is then unchanged.
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    old = checkpoint_nodes(checkpoint)
    if old == nodes:
        return checkpoint
    checkpoint.verify(checkpoint.fingerprint)  # present, sizes, headers and crc32 of small files
    for i in range(old):
        for name in (SSD_SNAPSHOT, TRAINER_STATE):
            if not (checkpoint.node(i) / name).exists():
                raise CheckpointError(str(checkpoint.path), f"node-{i}/{name}: missing")
    with checkpoints.staged(checkpoint.batch) as staging, ExitStack() as stack:
        work = staging / "work"  # the stores being built; removed before the commit
        for part in _parts(checkpoint):  # one store, or one per row group (tables of several layouts)
            width = _width(checkpoint, part)
            per_file = int(rows_per_file or default_rows_per_file(width))
            stores = []
            for j in range(nodes):
                store = SSDPS(work / f"new-{j}" / part, width, background=False, rows_per_file=per_file)
                stack.callback(store.close)
                stores.append(store)
            out = _Outputs(stores, per_file)
            for i in range(old):
                _scan_into(checkpoint, i, work / f"old-{i}" / part, out, part)
            for j in range(nodes):
                out.flush(j)
                stores[j].snapshot(node_dir(staging, j) / SSD_SNAPSHOT / part)
        for j in range(nodes):
            shutil.copyfile(checkpoint.node(j % old) / TRAINER_STATE, node_dir(staging, j) / TRAINER_STATE)
        _split_admission(checkpoint, old, nodes, staging)
        stack.close()
        shutil.rmtree(work)
        record = {**checkpoint.meta, **(meta or {}), "nodes": nodes, "reshaped_from": old}
        return checkpoints.commit(staging, checkpoint.batch, record, fingerprint=checkpoint.fingerprint)
    raise AssertionError("unreachable")  # pragma: no cover - staged() re-raises


def _parts(checkpoint: Checkpoint) -> list[str]:
    """The stores of a node's snapshot: ``[""]`` (the snapshot itself), or with tables of several
    row layouts one subdirectory per row group (``group-G-width-W``, node 0's)."""
    root = checkpoint.node(0) / SSD_SNAPSHOT
    if (root / "SNAPSHOT.json").exists():
        return [""]
    groups = sorted(p.name for p in root.glob("group-*-width-*") if p.is_dir())
    return groups or [""]


def _width(checkpoint: Checkpoint, part: str = "") -> int:
    """Floats per row of the checkpoint's rows of store ``part`` (node 0's snapshot record)."""
    path = checkpoint.node(0) / SSD_SNAPSHOT / part / "SNAPSHOT.json"
    try:
        return int(json.loads(path.read_text())["width"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = "/".join(x for x in (SSD_SNAPSHOT, part) if x)
        raise CheckpointError(str(checkpoint.path), f"node-0/{where}/SNAPSHOT.json: unreadable: {e}") from None


def _scan_into(checkpoint: Checkpoint, i: int, work: Path, out: _Outputs, part: str = "") -> None:
    """Stream old node ``i``'s rows into ``out``, one parameter file at a time, through a store of
    links to the snapshot's files (the snapshot is never opened as a store: nothing in it changes)."""
    try:
        restore_snapshot(checkpoint.node(i) / SSD_SNAPSHOT / part, work)
        with SSDPS(work, background=False) as store:
            if store.width != out.stores[0].width:
                raise CheckpointError(
                    str(checkpoint.path), f"node-{i}/{SSD_SNAPSHOT}: rows of {store.width} floats, node 0's of another"
                )
            for keys, rows in store.scan():
                out.add(keys, rows)
    except SSDError as e:
        if isinstance(e, OSError):
            raise  # a disk that refused: staged() names the directory and the bytes
        # name the checkpoint's file, not its link in the work directory
        why = str(e).replace(f"{work}/", "").replace(f"{checkpoint.node(i) / SSD_SNAPSHOT / part}/", "")
        raise CheckpointError(str(checkpoint.path), f"node-{i}/{SSD_SNAPSHOT}/{why}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
