"""The one family of hpsray errors: every error hpsray raises on purpose derives from :class:`HpsrayError`.

::

    HpsrayError
    ├── ConfigError        (also ValueError)    a bad job file: "FILE: dotted.key: reason", or a bad
    │                                           environment variable: "environment: NAME: reason"
    ├── DataError          (also ValueError)    bad input: "FILE line N: reason: detail"
    │   └── TooMuchBadInput                     lenient mode gave up
    ├── CapacityError      (also RuntimeError)  the pinned working set does not fit MEM-PS
    │   └── TableFullError                      a hash table has no free row for an insert
    ├── DiskFullError      (also OSError)       a write refused for want of space: names directory, bytes
    │                                           needed (``needed``) and free (``free``)
    ├── SSDError                                SSD-PS storage (closed store, ...)
    │   ├── CorruptFileError                    a parameter file or the manifest fails its checks
    │   ├── SSDFullError   (+ DiskFullError)    the disk refused a write; nothing was recorded
    │   └── TableImportError                    ``[tiers] init_from`` names a table that cannot be
    │                                           loaded: names the file and why; nothing was loaded
    ├── CheckpointError                         a checkpoint that cannot be written or used: "PATH: reason"
    │   └── CheckpointFullError (+ DiskFullError) the disk refused a checkpoint write; the staging
    │                                           directory was removed, earlier checkpoints stay usable
    ├── ExportError        (also ValueError)    an export directory that cannot be read back
    ├── TrainingStopped    (also RuntimeError)  a stage failed in ``fit()``; what trained was kept
    ├── PeerFailedError    (also RuntimeError)  this trainer is fine, another node's failed the batch
    ├── NoSpareNode        (also RuntimeError)  a node is gone and no node can take its place
    ├── RayStartError      (also ConnectionError) Ray did not come up, or could not be joined, in time
    ├── DataPlaneError     (also ConnectionError) a connection between hpsray's processes broke the wire's
    │   │                                       rules (malformed, oversized, out-of-order frame): closed
    │   └── AuthenticationError                 a connection that did not prove it belongs to the job
    ├── NetnsUnavailable   (also RuntimeError)  namespace hosts cannot be made here (not root, no ``ip``)
    ├── ServingError                            a model directory that cannot be served
    │   └── BadRequest     (also ValueError)    a request refused with HTTP 400; the message is the reason
    ├── FaultTimeout       (also TimeoutError)  a wait on another process passed ``[cluster] fault_timeout_s``:
    │                                           names what it waited for and who is missing
    └── WorkingSetError    (also RuntimeError)  the trainer lacks rows its owners counted on it holding
        └── MissingRowsError                    a batch's keys have no row once its loans are in

The second bases are kept for callers that catch the builtin kind (``except ValueError``). Every
class is defined here and imported from here only (no package re-exports one). The one exception
outside the family is :class:`PrivateControlFlow`: the base of a module's private exception that
it raises and catches itself to leave a nested computation early (each subclass says where it is
caught); tests/test_exception_family.py checks that every exception class derives from one of the two. This module
imports nothing of hpsray, so every layer may use it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CapacityError",
    "CheckpointError",
    "CheckpointFullError",
    "ConfigError",
    "CorruptFileError",
    "AuthenticationError",
    "DataPlaneError",
    "DataError",
    "DiskFullError",
    "ExportError",
    "FaultTimeout",
    "HpsrayError",
    "MissingRowsError",
    "NetnsUnavailable",
    "NoSpareNode",
    "PrivateControlFlow",
    "PeerFailedError",
    "RayStartError",
    "SSDError",
    "SSDFullError",
    "BadRequest",
    "ServingError",
    "TableImportError",
    "TableFullError",
    "TooMuchBadInput",
    "TrainingStopped",
    "WorkingSetError",
    "caused_by",
]


class HpsrayError(Exception):
    """Root of every error hpsray raises on purpose.

    Pickles with its fields (Ray ships errors between processes): the copy is made without
    calling ``__init__`` again, from the builtin's ``args`` and the instance's attributes, so
    a subclass needs no pickling code of its own.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class PrivateControlFlow(Exception):
    """Not an error: a module's private signal, raised and caught by that module (a subclass's
    docstring says where). Outside :class:`HpsrayError` on purpose: no caller is meant to catch it."""


def _rebuild(cls: type[HpsrayError], args: tuple, state: dict[str, Any]) -> HpsrayError:
    """An error of class ``cls`` with ``args`` and attributes ``state`` (see HpsrayError)."""
    error = cls.__new__(cls, *args)
    if isinstance(error, OSError):
        OSError.__init__(error, *args)  # errno and strerror come from args here
    else:
        error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(HpsrayError, ValueError):
    """A bad job file: ``str(e)`` is ``"FILE: dotted.key: reason"``; or a bad environment
    variable (:mod:`hpsray.env`): ``"environment: NAME: reason"``."""

    def __init__(self, where: str, key: str, reason: str) -> None:
        self.where, self.key, self.reason = where, key, reason
        super().__init__(f"{where}: {key}: {reason}" if key else f"{where}: {reason}")


class DataError(HpsrayError, ValueError):
    """Bad input, naming where (``file``, ``line`` for text or ``row`` for Parquet) and why.

    ``str(err)`` reads like ``data/part-0.tsv.gz line 17: wrong_column_count: expected 40
    columns, got 39``.
    """

    def __init__(
        self,
        file: str | None,
        reason: str,
        detail: str = "",
        *,
        line: int | None = None,
        row: int | None = None,
    ) -> None:
        self.file = file
        self.reason = reason
        self.detail = detail
        self.line = line
        self.row = row
        super().__init__(self._message())

    def location(self) -> str:
        where = self.file or "<input>"
        if self.line is not None:
            where += f" line {self.line}"
        elif self.row is not None:
            where += f" row {self.row}"
        return where

    def _message(self) -> str:
        return f"{self.location()}: {self.reason}" + (f": {self.detail}" if self.detail else "")


class TooMuchBadInput(DataError):
    """Lenient mode gave up: the fraction of bad rows or files passed ``max_bad_fraction``."""


class CapacityError(HpsrayError, RuntimeError):
    """The pinned working set does not fit: the message names capacity, pins and demand."""


class TableFullError(CapacityError):
    """Raised when an insert needs more rows than the table has free."""


class SSDError(HpsrayError):
    """Base class of SSD-PS (storage) errors."""


class TableImportError(SSDError):
    """An import directory that cannot be loaded; the message names the file and what is wrong."""


class CorruptFileError(SSDError):
    """A parameter file (or the manifest) fails its checks; the message names file and cause."""


class DiskFullError(HpsrayError, OSError):
    """The disk (or a quota, or a file-size limit) refused a write for want of space.

    ``errno`` is the refusal (ENOSPC, EDQUOT, EFBIG), ``strerror`` the message, which names the
    directory and the bytes needed; ``directory``, ``needed`` (bytes the operation needed: a
    lower bound where the message says "more than") and ``free`` (bytes free after the failed
    operation was cleaned up) are kept as fields (``None`` when unknown). Catch this one class
    for every kind below.
    """

    def __init__(
        self,
        errno: int,
        message: str,
        *,
        directory: str | None = None,
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        super().__init__(errno, message)
        self.directory, self.needed, self.free = directory, needed, free


class SSDFullError(SSDError, DiskFullError):
    """The disk (or a file-size limit) refused an SSD-PS write; nothing of the failed operation
    was recorded and the store stays readable."""


class CheckpointError(HpsrayError):
    """A checkpoint that cannot be written or used: ``str(e)`` is ``"PATH: reason"`` (the
    checkpoint or checkpoint directory, then e.g. a missing file, a size or checksum mismatch,
    an unknown format, another job's fingerprint)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


class CheckpointFullError(CheckpointError, DiskFullError):
    """The disk refused a checkpoint write; the staging directory was removed and the earlier
    checkpoints stay usable. Constructed like :class:`DiskFullError`; ``path`` is the
    directory, ``reason`` the message."""

    def __init__(
        self,
        errno: int,
        message: str,
        *,
        directory: str | None = None,
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        DiskFullError.__init__(self, errno, message, directory=directory, needed=needed, free=free)
        self.path, self.reason = directory or "", message


class ExportError(HpsrayError, ValueError):
    """An export directory that cannot be read back: names the file and the reason."""


class TrainingStopped(HpsrayError, RuntimeError):
    """A stage failed during ``fit()``; what trained before it was kept (see "Failures" in
    docs/architecture.md).

    ``cause`` is the failure as raised (e.g. a ``RayTaskError`` wrapping a ``DataError``);
    ``saved_batches`` counts the batches whose rows were written back and flushed to SSD-PS.
    """

    def __init__(self, cause: BaseException, saved_batches: int) -> None:
        self.cause = cause
        self.saved_batches = saved_batches
        root = cause
        while (inner := getattr(root, "cause", None)) is not None and inner is not root:
            root = inner
        super().__init__(
            f"{type(root).__name__}: {root}\n(the rows of the {saved_batches} batches trained "
            f"before the failure were written back and flushed to SSD-PS)"
        )


class PeerFailedError(HpsrayError, RuntimeError):
    """This trainer had its inputs, but another node's trainer failed the batch (the trainers
    agree on that before each batch, so none waits in the collective): the root cause is the
    other trainer's error."""

    def __init__(self, batch_id: object) -> None:
        self.batch_id = batch_id
        super().__init__(f"batch {batch_id} failed on another node; see that trainer's error")


class FaultTimeout(HpsrayError, TimeoutError):
    """A wait on another process (a Ray call, a collective, an aggregation socket, a rendezvous)
    passed ``[cluster] fault_timeout_s`` (docs/operations.md: Network faults).

    ``waited_for`` says what was awaited (and where), ``timeout_s`` how long, ``missing`` who
    was found gone or silent when it expired (Ray's node and actor state: "node 1 (Ray node
    ab12…, 10.77.0.2) is dead: Trainer[node 1], ..."); empty when every party looked alive.
    """

    def __init__(self, waited_for: str, timeout_s: float, missing: tuple[str, ...] | list[str] = ()) -> None:
        self.waited_for, self.timeout_s, self.missing = waited_for, float(timeout_s), tuple(missing)
        who = (
            "; ".join(self.missing)
            if self.missing
            else "no node or actor was found lost (a call slower than fault_timeout_s? raise it)"
        )
        super().__init__(f"waited {self.timeout_s:g} s (cluster.fault_timeout_s) for {waited_for}: {who}")


class NoSpareNode(HpsrayError, RuntimeError):
    """A node of the job is gone and the cluster has no other node to take its place."""


class RayStartError(HpsrayError, ConnectionError):
    """Ray did not come up (or could not be joined) within the bound; the message says why."""


class DataPlaneError(HpsrayError, ConnectionError):
    """A connection between hpsray's own processes broke the wire's rules (a malformed, oversized
    or out-of-order frame; docs/operations.md: Listening sockets): it was closed. ``peer`` names
    the other end, ``reason`` what was wrong."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer, self.reason = peer, reason
        super().__init__(f"{peer}: {reason}; the connection was closed")


class AuthenticationError(DataPlaneError):
    """A connection that did not prove it belongs to the job (no, or a wrong, job secret in the
    HMAC challenge): refused before any frame was read."""


class NetnsUnavailable(HpsrayError, RuntimeError):
    """Network-namespace hosts cannot be made on this machine (not root, no ``ip``, ...)."""


class ServingError(HpsrayError):
    """A model directory that cannot be served (no export there, no input schema, bad options)."""


class BadRequest(ServingError, ValueError):
    """A request the endpoint refuses with HTTP 400; ``str(e)`` is the reason sent back."""


class WorkingSetError(HpsrayError, RuntimeError):
    """An owner did not ship rows it counted on the trainer holding from its previous batch,
    and the trainer does not hold them (its working set was lost, e.g. reset, while the
    owner's leases were kept). A broken protocol, not bad input."""

    def __init__(self, absent: int, held: int, first: int) -> None:
        self.absent, self.held, self.first = absent, held, first
        super().__init__(
            f"the trainer lacks {absent} of the {held} rows its owners did not ship because it held them "
            f"in the batch before (first key: {first}); its working set was lost while the owners kept their leases"
        )


class MissingRowsError(WorkingSetError):
    """Keys of a batch have no row in the trainer's working set once its loans are in: the
    loans did not cover the batch. A broken protocol, not bad input."""

    def __init__(self, absent: int, total: int, first: int) -> None:
        self.absent, self.held, self.first = absent, total, first
        HpsrayError.__init__(
            self,
            f"{absent} of the batch's {total} key occurrences have no row in the trainer's working set "
            f"(first key: {first}); the owners' loans did not cover the batch",
        )


def caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``error``, or an error it wraps (Ray's ``RayTaskError.cause``, ``__cause__``), is a ``kind``."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__
    return False
