"""A directory of numbered checkpoints: staging, atomic commit, pruning, finding the latest good one.

Layout of ``DIR``::

    ckpt-000120/                      a committed checkpoint: 120 batches trained
        CHECKPOINT.json               written last, before the rename (record.py)
        node-0/ ... node-1/ ...       what each node's writers put there (e.g. an SSD-PS snapshot)
        ...                           the driver's files (e.g. the dense state)
    ckpt-000123/
    .ckpt-000126.tmp-<uuid>/          staging: a checkpoint being written, or a crash's leftover

A checkpoint becomes visible only by the rename of its whole staging directory, after every file
and directory in it and its ``CHECKPOINT.json`` were fsynced, so a directory named ``ckpt-N``
without a sound record is damage, never a half-written checkpoint; staging leftovers are never
read and are removed by the next commit. One writer per directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsray.checkpoint.record import FORMAT, NAME, VERSION, check_files, describe_files, read_record, seal
from hpsray.checkpoint.space import full_cause, full_error, written_bytes
from hpsray.errors import CheckpointError, CheckpointFullError
from hpsray.fileio import fsync_dir

__all__ = ["Checkpoint", "Checkpoints", "node_dir"]

log = logging.getLogger("hpsray.checkpoint")

_COMMITTED = re.compile(r"ckpt-(\d{6,})")
_LEFTOVER = re.compile(r"\.ckpt-(\d{6,})\.(tmp|old)-[0-9a-f]+")


def _name(batch: int) -> str:
    return f"ckpt-{batch:06d}"


def node_dir(root: str | os.PathLike, node: int) -> Path:
    """Where node ``node``'s files go in a staging directory or checkpoint: ``root/node-<node>``."""
    return Path(root) / f"node-{node}"


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint (its record read and checked; its files checked by :meth:`verify`).

    ``skipped`` lists, for a checkpoint :meth:`Checkpoints.latest` returned, the newer ones it
    passed over as damaged, each with its reason.
    """

    path: Path
    batch: int
    fingerprint: str | None
    meta: dict
    created: float
    files: list[dict]
    skipped: tuple[str, ...] = field(default=())

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        """Read a checkpoint's ``CHECKPOINT.json``; raises :class:`~hpsray.errors.CheckpointError`
        for a missing or damaged record, or one of another batch than the directory's name."""
        p = Path(path)
        record = read_record(str(p))
        m = _COMMITTED.fullmatch(p.name)
        if m is None or int(m.group(1)) != record.get("batch"):
            raise CheckpointError(str(p), f"{NAME} records batch {record.get('batch')!r}, the directory's name another")
        return cls(
            p, int(record["batch"]), record.get("fingerprint"), record["meta"], record["created"], record["files"]
        )

    def node(self, node: int) -> Path:
        """Node ``node``'s directory in this checkpoint."""
        return node_dir(self.path, node)

    def verify(self, fingerprint: str | None = None, *, deep: bool = False) -> None:
        """Check the checkpoint: its job's ``fingerprint`` (when given), every recorded file
        (present, its size, its crc32 or, for SSD-PS parameter files, their header; ``deep``: the
        parameter files' every checksum, reading them whole) and that no unrecorded file is there.
        Raises :class:`~hpsray.errors.CheckpointError` naming the checkpoint and the reason."""
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise CheckpointError(
                str(self.path),
                f"written by another job (fingerprint {self.fingerprint!r}, this job's is {fingerprint!r}); "
                "refusing to resume from it",
            )
        check_files(str(self.path), self.files, deep)


class Checkpoints:
    """The checkpoint directory ``directory`` (created if needed), keeping the ``keep`` newest.

    Writing one::

        with checkpoints.staged(batch) as staging:        # or stage() ... commit() / abort()
            ssd.snapshot(node_dir(staging, 0) / "ssd")    # each node's writers, then the driver's
            torch.save(dense, staging / "dense.pt")
            checkpoints.commit(staging, batch, {"examples": n}, fingerprint=fp)

    Resuming: ``checkpoints.latest(fp)`` (see there for what it refuses and what it skips).

    ``durable``: whether a checkpoint here survives the loss or damage of the disks the job
    trains on (``False``: an SSD-PS snapshot here hard-links the live parameter files).
    """

    durable = False

    def __init__(self, directory: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = int(keep)
        self.directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, keep={self.keep})"

    # -- listing ----------------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """The committed checkpoint directories (``ckpt-N``), newest (highest batch) first; their
        records are not read."""
        return self._local_dirs()

    def _local_dirs(self) -> list[Path]:
        """:meth:`committed` of this directory (what pruning and the checks here use, also where
        a subclass's :meth:`committed` lists another store)."""
        found = []
        for entry in os.scandir(self.directory):
            m = _COMMITTED.fullmatch(entry.name)
            if m is not None and entry.is_dir(follow_symlinks=False):
                found.append((int(m.group(1)), Path(entry.path)))
        return [p for _, p in sorted(found, reverse=True)]

    def durable_against(self, paths: list[str]) -> bool:
        """Whether a checkpoint here is a copy of the SSD-PS directories ``paths`` (as this host
        sees them): :attr:`durable`, or this directory is on another file system than every one
        of them, so that a snapshot copies the parameter files instead of linking them."""
        if self.durable:
            return True
        mine = os.stat(self.directory).st_dev
        devices = [os.stat(p).st_dev for p in paths if os.path.exists(p)]
        return bool(devices) and all(d != mine for d in devices)

    def fingerprint_of(self, path: Path) -> str | None:
        """The job fingerprint recorded by the committed checkpoint ``path`` (``None`` if damaged)."""
        try:
            return Checkpoint.open(path).fingerprint
        except CheckpointError:
            return None

    def latest(self, fingerprint: str | None = None, *, deep: bool = False) -> Checkpoint | None:
        """The newest checkpoint that verifies (:meth:`Checkpoint.verify`, ``deep`` as there);
        ``None`` when the directory holds none at all.

        A newer checkpoint that fails its checks (no or a damaged ``CHECKPOINT.json``, a missing,
        truncated or damaged file) is skipped *only* when an older one verifies: each skipped
        one is logged as a warning and listed with its reason in the result's ``skipped``. When
        none verifies this raises :class:`~hpsray.errors.CheckpointError` with every reason
        (never ``None``: that would silently restart the job from scratch). A checkpoint of
        another job (``fingerprint`` given and different) is always refused with that reason,
        never skipped.
        """
        skipped: list[str] = []
        for path in self._local_dirs():
            try:
                ckpt = Checkpoint.open(path)
            except CheckpointError as e:
                skipped.append(str(e))
                continue
            if fingerprint is not None and ckpt.fingerprint != fingerprint:
                ckpt.verify(fingerprint)  # raises: another job's
            try:
                ckpt.verify(deep=deep)
            except CheckpointError as e:
                skipped.append(str(e))
                continue
            for reason in skipped:
                log.warning("checkpoint skipped, resuming from %s instead: %s", ckpt.path, reason)
            return Checkpoint(
                ckpt.path, ckpt.batch, ckpt.fingerprint, ckpt.meta, ckpt.created, ckpt.files, tuple(skipped)
            )
        if skipped:
            raise CheckpointError(str(self.directory), "no checkpoint verifies: " + "; ".join(skipped))
        return None

    # -- writing ----------------------------------------------------------------------------

    def stage(self, batch: int) -> Path:
        """A new, empty staging directory ``DIR/.ckpt-<batch>.tmp-<uuid>`` for the checkpoint of
        ``batch`` (batches trained); writers put their files there, then :meth:`commit` or
        :meth:`abort`. Raises :class:`~hpsray.errors.CheckpointFullError` when the disk refuses."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        staging = self.directory / f".{_name(batch)}.tmp-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
        except OSError as e:
            if full_cause(e) is None:
                raise
            raise full_error(e, str(self.directory), batch, 0, self._latest_name()) from e
        return staging

    def abort(self, staging: str | os.PathLike) -> None:
        """Remove a staging directory and what was written there (idempotent)."""
        shutil.rmtree(staging, ignore_errors=True)

    @contextmanager
    def staged(self, batch: int) -> Iterator[Path]:
        """:meth:`stage`, yielding the staging directory; on an error inside the block the
        staging directory is removed, and a refusal for want of space (also one wrapped by a
        Ray task error) is raised as :class:`~hpsray.errors.CheckpointFullError` naming the
        directory and the bytes written before the refusal. Call :meth:`commit` inside."""
        staging = self.stage(batch)
        try:
            yield staging
        except BaseException as e:
            refusal = full_cause(e)
            needed = written_bytes(str(staging)) if refusal is not None else 0
            self.abort(staging)
            if refusal is None or isinstance(e, CheckpointFullError):
                raise
            raise full_error(refusal, str(self.directory), batch, needed, self._latest_name()) from e
        self.abort(staging)  # left when the block did not commit

    def commit(
        self,
        staging: str | os.PathLike,
        batch: int,
        meta: Mapping[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
        elsewhere: Sequence[Mapping[str, Any]] = (),
    ) -> Checkpoint:
        """Seal the staging directory as the checkpoint of ``batch`` and make it the latest.

        Fsyncs every file and directory under ``staging``, writes ``CHECKPOINT.json`` (crc32 of
        every file but SSD-PS parameter files, whose size is recorded and whose own checksums
        serve: see :mod:`~hpsray.checkpoint.record`; cost: one read of the other files), fsyncs it,
        renames ``staging`` to ``ckpt-<batch>`` and fsyncs the directory. Then prunes: removes
        checkpoints of later batches (an abandoned run's: the one committed is the latest), all
        but the ``keep`` newest, and staging leftovers of batches up to ``batch``. A checkpoint of
        the same batch is replaced.

        Raises :class:`~hpsray.errors.CheckpointError` when ``staging`` is not this directory's
        staging directory of ``batch``, when ``meta`` is not JSON-able, or when the directory
        holds checkpoints of another job (another ``fingerprint``: mixing them would let this one
        prune that one's); :class:`~hpsray.errors.CheckpointFullError` when the disk refuses a
        write. On any failure but the first ``staging`` is removed; the earlier checkpoints stay
        as they were.

        ``elsewhere``: record entries (as :func:`~hpsray.checkpoint.record.describe_files` makes)
        of files the record lists but that are not under ``staging`` (another host's, already in
        object storage: :mod:`~hpsray.checkpoint.remote`); this directory's copy then does not
        verify on its own.
        """
        staging = Path(staging)
        if staging.parent.resolve() != self.directory.resolve() or not staging.name.startswith(f".{_name(batch)}.tmp-"):
            raise CheckpointError(str(staging), f"not a staging directory of {self.directory} for batch {batch}")
        sealed = b""
        created, meta_d, files = time.time(), dict(meta or {}), []
        try:
            self._refuse_foreign(fingerprint)
            body = {
                "format": FORMAT,
                "version": VERSION,
                "batch": int(batch),
                "fingerprint": fingerprint,
                "created": created,
                "meta": meta_d,
            }
            try:
                sealed = seal({**body, "files": []})  # refuse a meta that is not JSON-able early
            except (TypeError, ValueError) as e:
                raise CheckpointError(str(staging), f"meta is not JSON-able: {e}") from None
            files = describe_files(str(staging))
            here = {e["path"] for e in files}
            files += [dict(e) for e in elsewhere if e["path"] not in here]
            body["files"] = files
            sealed = seal(body)
            fd = os.open(staging / NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(sealed)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(str(staging))
            final = self._rename(staging, batch)
        except BaseException as e:
            refusal = full_cause(e)
            needed = written_bytes(str(staging)) + len(sealed) if refusal is not None else 0
            self.abort(staging)
            if refusal is None:
                raise
            raise full_error(refusal, str(self.directory), batch, needed, self._latest_name()) from e
        self._prune(batch)
        return Checkpoint(final, int(batch), fingerprint, meta_d, created, files)

    # -- parts ------------------------------------------------------------------------------

    def _latest_name(self) -> str | None:
        committed = self._local_dirs()
        return committed[0].name if committed else None

    def _refuse_foreign(self, fingerprint: str | None) -> None:
        for path in self._local_dirs():
            try:
                other = read_record(str(path)).get("fingerprint")
            except CheckpointError:
                continue  # damaged: not evidence of another job
            if other != fingerprint:
                raise CheckpointError(
                    str(self.directory),
                    f"holds checkpoints of another job ({path.name} has fingerprint {other!r}, this job's is "
                    f"{fingerprint!r}); use another directory, or remove them",
                )

    def _rename(self, staging: Path, batch: int) -> Path:
        """Rename ``staging`` to ``ckpt-<batch>`` (swapping out an existing one) and fsync."""
        final = self.directory / _name(batch)
        old = None
        if final.exists():
            old = self.directory / f".{_name(batch)}.old-{uuid.uuid4().hex}"
            os.rename(final, old)
        try:
            os.rename(staging, final)
        except BaseException:
            if old is not None:
                os.rename(old, final)
            raise
        fsync_dir(str(self.directory))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _prune(self, batch: int) -> None:
        """After committing ``batch``: remove later and surplus checkpoints and old leftovers."""
        kept = 0
        for path in self._local_dirs():
            b = int(_COMMITTED.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            if b <= batch and kept < self.keep:
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)
        for entry in os.scandir(self.directory):
            m = _LEFTOVER.fullmatch(entry.name)
            if m is not None and int(m.group(1)) <= batch:
                shutil.rmtree(entry.path, ignore_errors=True)
        fsync_dir(str(self.directory))
