"""SSD-PS snapshots: one consistent state of a store kept in a directory of its own, and restoring it.

A snapshot directory holds::

    SNAPSHOT.json   format, version, width, rows, next file number, the files (name, size)
    MANIFEST        a fresh manifest naming exactly those files, so that the state reopens
    <no>.hps        the store's live parameter files: hard links (copies where a link fails)

Parameter files are immutable (written once under a temporary name, never modified, only
unlinked by compaction), so a hard link references the file as it was: a later compaction
unlinking the store's name leaves the snapshot's name, and the data, in place. Never write to a
snapshot's files: they share their blocks with the store's. The space they hold is not counted in
the store's ``disk_bytes`` (nor bounded by its ``max_space_ratio``) once compaction dropped them.

:func:`take_snapshot` (``SSDPS.snapshot``) takes the store's compaction lock while it lists and
links the files (dumps go on: they add files, never remove one); :func:`restore_snapshot` builds a
fresh store directory from a snapshot that ``SSDPS(directory)`` opens with exactly its rows.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid

import numpy as np

from hpsray.errors import CorruptFileError, SSDError
from hpsray.fileio import FULL_ERRNOS, fsync_dir, fsync_path, full_error, write_json
from hpsray.tiers.ssd.manifest import NAME as MANIFEST_NAME
from hpsray.tiers.ssd.manifest import Manifest, write_manifest
from hpsray.tiers.ssd.paramfile import HEADER_BYTES, decode_header, file_name, parse_file_name, read_file
from hpsray.tiers.ssd.state import StoreState

__all__ = ["FORMAT", "NAME", "VERSION", "check_param_file", "restore_snapshot", "take_snapshot", "verify_snapshot"]

NAME = "SNAPSHOT.json"
FORMAT = "hpsray-ssd-snapshot"
VERSION = 1
_META_BYTES = 4096  # about what SNAPSHOT.json and MANIFEST take beside the files (per 100 files)


def _link_or_copy(src: str, dst: str, link: bool) -> bool:
    """Hard link ``src`` as ``dst``, or copy it (and fsync the copy) where linking fails (another
    file system, no links there, too many links); returns whether it linked."""
    if link:
        try:
            os.link(src, dst)
            return True
        except OSError as e:
            if e.errno in FULL_ERRNOS or e.errno == errno.ENOENT:
                raise
    shutil.copyfile(src, dst)
    fsync_path(dst)
    return False


def _link_files(src_dir: str, dst_dir: str, files: list[tuple[int, int]], link: bool, done: dict) -> None:
    """Link (or copy) parameter files ``(number, size)`` from ``src_dir`` into ``dst_dir``,
    counting ``linked``, ``copied`` and ``copying`` (a copy was needed) in ``done`` as it goes."""
    for no, _ in files:
        name = file_name(no)
        done["copying"] = done["copying"] or not link
        if _link_or_copy(os.path.join(src_dir, name), os.path.join(dst_dir, name), link):
            done["linked"] += 1
        else:
            done["copying"] = True
            done["copied"] += 1


def _needed(files: list[tuple[int, int]], done: dict) -> int:
    """Bytes a snapshot or restore of ``files`` needs: metadata, plus the files once they are copied."""
    meta = _META_BYTES * (1 + len(files) // 100)
    return meta + (sum(size for _, size in files) if done["copying"] else 0)


def take_snapshot(store: StoreState, dest: str | os.PathLike, *, link: bool = True) -> dict:
    """Reference the current state of a store (``store``: its shared state) in ``dest`` (absent
    or empty; created): see the module docstring. Consistent while dumps and background
    compaction run: the live file set is read under the store's lock, and compaction waits
    until every file is linked (or copied: copies hold compaction back for their duration).
    ``link=False`` always copies.

    Returns ``{"files", "bytes", "rows", "linked", "copied", "dumps", "seconds"}`` (``dumps``:
    the store's dump count at the snapshot, whose state it holds). Raises
    :class:`~hpsray.errors.SSDFullError` naming ``dest`` and the bytes needed when the disk
    refuses a write; ``dest`` is then removed (left empty if it existed) and the store unchanged.
    """
    t0 = time.perf_counter()
    dest = os.fspath(dest)
    existed = os.path.isdir(dest)
    if existed and os.listdir(dest):
        raise SSDError(f"{dest}: snapshot destination is not empty")
    os.makedirs(dest, exist_ok=True)
    files: list[tuple[int, int]] = []
    done = {"linked": 0, "copied": 0, "copying": False}
    try:
        with store.compaction_lock:  # no pass unlinks a listed file before it is linked
            store.check_open()
            with store.lock:
                f = store.files
                files = sorted((int(no), int(f.size[s])) for no, s in f.slot_of.items())
                rows, next_no, dumps = store.keys.size, store.next_file_no, int(store.stats["dumps"])
            _link_files(store.directory, dest, files, link, done)
        total = sum(size for _, size in files)
        write_manifest(dest, store.width, {no for no, _ in files}, next_no)
        record = {
            "format": FORMAT,
            "version": VERSION,
            "width": store.width,
            "rows": rows,
            "next_file_no": next_no,
            "created": time.time(),
            "files": [{"name": file_name(no), "size": size} for no, size in files],
        }
        write_json(os.path.join(dest, NAME), record, indent=1)
        fsync_dir(dest)
    except BaseException as e:
        shutil.rmtree(dest, ignore_errors=True)
        if existed:
            os.makedirs(dest, exist_ok=True)
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            what = f"a snapshot of {len(files)} parameter files"
            raise full_error(
                e, dest, _needed(files, done), what, "the snapshot was removed; the store is unchanged"
            ) from e
        raise
    return {
        "files": len(files),
        "bytes": total,
        "rows": rows,
        "linked": done["linked"],
        "copied": done["copied"],
        "dumps": dumps,
        "seconds": time.perf_counter() - t0,
    }


def check_param_file(path: str, size: int, deep: bool = False) -> None:
    """Check a parameter file against its recorded ``size``: it exists, has that size, and its
    header (magic, checksum, format, the size it implies) is sound; ``deep`` also reads it whole
    and verifies every checksum (index, rows, block table). Raises
    :class:`~hpsray.errors.CorruptFileError` naming the file and the reason."""
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing") from None
    if actual != size:
        raise CorruptFileError(f"{path}: size {actual} bytes, recorded {size} (truncated or replaced)")
    if deep:
        read_file(path)
        return
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(HEADER_BYTES), dtype=np.uint8)
    h = decode_header(head, path)
    if h.size != size:
        raise CorruptFileError(f"{path}: size {size} bytes, its header says {h.size}")
    no = parse_file_name(os.path.basename(path))
    if no is not None and h.file_no != no:
        raise CorruptFileError(f"{path}: header names file {h.file_no}")


def verify_snapshot(snapshot_dir: str | os.PathLike, *, deep: bool = False) -> dict:
    """Check a snapshot: its ``SNAPSHOT.json`` (format, version), its ``MANIFEST`` (names exactly
    the recorded files, same width) and every file (:func:`check_param_file`; ``deep`` reads them
    whole). Returns the ``SNAPSHOT.json`` record; raises :class:`~hpsray.errors.CorruptFileError`
    naming the file and the reason."""
    d = os.fspath(snapshot_dir)
    path = os.path.join(d, NAME)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing (not an SSD-PS snapshot, or an interrupted one)") from None
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{path}: unreadable: {e}") from None
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise CorruptFileError(
            f"{path}: format {record.get('format')!r} version {record.get('version')!r}, "
            f"this build reads {FORMAT!r} version {VERSION}"
        )
    names = {e["name"] for e in record["files"]}
    mpath = os.path.join(d, MANIFEST_NAME)
    try:
        with open(mpath, "rb") as f:
            width, live, _, _, _ = Manifest.replay(f.read(), mpath)
    except FileNotFoundError:
        raise CorruptFileError(f"{mpath}: missing") from None
    if width != record["width"] or {file_name(no) for no in live} != names:
        raise CorruptFileError(f"{mpath}: names other files (or another width) than {path}")
    for entry in record["files"]:
        check_param_file(os.path.join(d, entry["name"]), int(entry["size"]), deep)
    return record


def _remove_leftovers(directory: str) -> None:
    """Remove the sibling directories an interrupted :func:`restore_snapshot` left."""
    parent, base = os.path.split(directory)
    for name in os.listdir(parent or "."):
        if name.startswith((base + ".restore-", base + ".old-")):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def restore_snapshot(
    snapshot_dir: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    replace: bool = False,
    link: bool = True,
    deep: bool = False,
) -> dict:
    """Build the store directory ``directory`` from a snapshot; ``SSDPS(directory)`` then opens
    with exactly the snapshotted rows (the snapshot stays as it was, usable again).

    The snapshot is verified first (:func:`verify_snapshot`, ``deep`` as there). The new store is
    built beside ``directory`` (files linked, or copied where linking fails or ``link=False``; a
    fresh manifest) and renamed into place. An existing non-empty ``directory`` is refused unless
    ``replace``: then it is swapped out and removed (close any store open on it first). Returns
    ``{"files", "bytes", "rows", "linked", "copied", "seconds"}``. Raises
    :class:`~hpsray.errors.CorruptFileError` for a damaged snapshot, :class:`~hpsray.errors.SSDError`
    for a non-empty target, :class:`~hpsray.errors.SSDFullError` (naming the directory and the
    bytes needed) when the disk refuses a write; ``directory`` is then unchanged.
    """
    t0 = time.perf_counter()
    src, directory = os.fspath(snapshot_dir), os.path.abspath(os.fspath(directory))
    record = verify_snapshot(src, deep=deep)
    if os.path.isdir(directory) and os.listdir(directory) and not replace:
        raise SSDError(f"{directory}: not empty; restore_snapshot(..., replace=True) replaces the store there")
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    _remove_leftovers(directory)
    files = [(int(parse_file_name(e["name"]) or 0), int(e["size"])) for e in record["files"]]
    total = sum(size for _, size in files)
    tmp = f"{directory}.restore-{uuid.uuid4().hex}"
    old = f"{directory}.old-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    done = {"linked": 0, "copied": 0, "copying": False}
    try:
        _link_files(src, tmp, files, link, done)
        write_manifest(tmp, int(record["width"]), {no for no, _ in files}, int(record["next_file_no"]))
        fsync_dir(tmp)
        if os.path.exists(directory):
            os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException:
            if os.path.exists(old):
                os.rename(old, directory)
            raise
        fsync_dir(os.path.dirname(directory))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            what = f"restoring {len(files)} parameter files from {src}"
            raise full_error(
                e, os.path.dirname(directory), _needed(files, done), what, f"{directory} is unchanged"
            ) from e
        raise
    shutil.rmtree(old, ignore_errors=True)
    return {
        "files": len(files),
        "bytes": total,
        "rows": int(record["rows"]),
        "linked": done["linked"],
        "copied": done["copied"],
        "seconds": time.perf_counter() - t0,
    }
