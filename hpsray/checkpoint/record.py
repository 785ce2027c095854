"""``CHECKPOINT.json``: what a checkpoint holds, and checking a checkpoint against it.

The record (JSON) holds ``format``, ``version``, ``batch``, ``fingerprint`` (the job's, given by
the caller), ``created`` (Unix time), ``meta`` (the caller's, JSON-able), ``files`` and ``crc32``,
the checksum of the rest of the record (canonical JSON: sorted keys, no spaces). Each file
(every regular file under the checkpoint, by relative POSIX path) is one entry:

* ``{"path", "size", "check": "crc32", "crc32"}``: crc32 (zlib) of its bytes, computed at commit;
* ``{"path", "size", "check": "param"}``: an SSD-PS parameter file (``*.hps`` starting with the
  format's magic). Those are immutable, large (a node's whole shard) and hard links of the
  store's files, so commit records only their size, and a check relies on the file's own
  checksums: its header (cheap) or, ``deep``, the whole file (index, rows, block table).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from typing import Any

from hpsray.errors import CheckpointError, CorruptFileError
from hpsray.tiers.ssd.paramfile import MAGIC, SUFFIX
from hpsray.tiers.ssd.snapshot import check_param_file

__all__ = ["FORMAT", "NAME", "VERSION", "check_files", "describe_files", "job_fingerprint", "read_record", "seal"]

NAME = "CHECKPOINT.json"
FORMAT = "hpsray-checkpoint"
VERSION = 1
_CHUNK = 1 << 20


def job_fingerprint(job: Mapping[str, Any]) -> str:
    """A short stable digest of what makes a job's checkpoints its own (model shape, optimizer,
    seeds, nodes, data: whatever the caller puts in ``job``); equal mappings give equal digests."""
    text = json.dumps(job, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _crc_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _is_param_file(path: str) -> bool:
    if not path.endswith(SUFFIX):
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _walk(root: str) -> list[str]:
    """Relative POSIX paths of the files under ``root`` (sorted); raises for anything but
    regular files and directories (a symlink could point anywhere)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise CheckpointError(os.path.join(dirpath, name), "a symbolic link; checkpoints hold files only")
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise CheckpointError(path, "not a regular file; checkpoints hold files only")
            out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(out)


def describe_files(root: str) -> list[dict]:
    """The ``files`` entries of every file under ``root`` (except ``CHECKPOINT.json``), each
    fsynced, and every directory fsynced, so that they are durable before the commit's rename.
    Reads every non-parameter file once for its crc32."""
    entries = []
    for rel in _walk(root):
        if rel == NAME:
            continue
        path = os.path.join(root, rel)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if _is_param_file(path):
            entries.append({"path": rel, "size": size, "check": "param"})
        else:
            entries.append({"path": rel, "size": size, "check": "crc32", "crc32": _crc_file(path)})
    for dirpath, _, _ in os.walk(root, topdown=False):
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return entries


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(body: dict) -> bytes:
    """The bytes of ``CHECKPOINT.json`` for ``body``: the record with its own ``crc32``."""
    return json.dumps({**body, "crc32": zlib.crc32(_canonical(body))}, indent=1).encode() + b"\n"


def read_record(checkpoint: str) -> dict:
    """The checked record of the checkpoint directory ``checkpoint``; raises
    :class:`~hpsray.errors.CheckpointError` naming it and the reason (missing, unreadable,
    damaged, unknown format or version)."""
    path = os.path.join(checkpoint, NAME)
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(checkpoint, f"no {NAME}: not a whole checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(checkpoint, f"{NAME} unreadable: {e}") from None
    if not isinstance(record, dict):
        raise CheckpointError(checkpoint, f"{NAME} is not a JSON object")
    crc = record.pop("crc32", None)
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise CheckpointError(
            checkpoint,
            f"{NAME}: format {record.get('format')!r} version {record.get('version')!r}, "
            f"this build reads {FORMAT!r} version {VERSION}",
        )
    if crc != zlib.crc32(_canonical(record)):
        raise CheckpointError(checkpoint, f"{NAME}: checksum mismatch (the record is damaged)")
    return record


def check_files(checkpoint: str, entries: list[dict], deep: bool = False) -> None:
    """Check every file of ``entries`` under ``checkpoint`` (exists, size, crc32 or the parameter
    file's own checks; ``deep``: parameter files read whole) and that no other file is there.
    Raises :class:`~hpsray.errors.CheckpointError` naming the checkpoint, the file and the reason."""
    listed = {e["path"] for e in entries}
    for e in entries:
        rel, size = e["path"], int(e["size"])
        path = os.path.join(checkpoint, *rel.split("/"))
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointError(checkpoint, f"{rel}: missing") from None
        if actual != size:
            raise CheckpointError(checkpoint, f"{rel}: size {actual} bytes, recorded {size} (truncated or replaced)")
        if e["check"] == "param":
            try:
                check_param_file(path, size, deep)
            except CorruptFileError as err:
                raise CheckpointError(checkpoint, f"{rel}: {str(err).removeprefix(path + ': ')}") from None
        elif e["check"] == "crc32":
            if _crc_file(path) != e["crc32"]:
                raise CheckpointError(checkpoint, f"{rel}: crc32 mismatch (the file is damaged)")
        else:
            raise CheckpointError(checkpoint, f"{rel}: unknown check {e['check']!r}")
    extra = [rel for rel in _walk(checkpoint) if rel != NAME and rel not in listed]
    if extra:
        raise CheckpointError(checkpoint, f"{extra[0]}: not recorded in {NAME} ({len(extra)} such files)")
