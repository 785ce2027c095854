"""Checkpoints: what a job needs to resume after a failure, in numbered, atomically committed
directories (docs/architecture.md, "Checkpoints").

* :class:`Checkpoints` (:mod:`~hpsray.checkpoint.checkpoints`) — a checkpoint directory:
  ``stage`` / ``staged``, ``commit`` (atomic rename, then pruning to ``keep``), ``abort``,
  ``latest`` (the newest that verifies).
* :class:`Checkpoint` — one committed checkpoint: its batch, meta, fingerprint, ``verify``.
* :mod:`~hpsray.checkpoint.record` — ``CHECKPOINT.json``: what it records and how files are checked.
* :mod:`~hpsray.checkpoint.reshard` — a checkpoint re-partitioned onto another number of nodes.

What goes into a checkpoint is the caller's (each node's SSD-PS snapshot, the driver's dense
state); this package knows only files. No Ray inside.
"""

from hpsray.checkpoint.checkpoints import Checkpoint, Checkpoints, node_dir
from hpsray.checkpoint.record import job_fingerprint

__all__ = ["Checkpoint", "Checkpoints", "job_fingerprint", "node_dir"]
