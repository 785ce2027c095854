"""The pipeline composition API: stages joined by bounded object-ref queues, scheduling,
metrics and the run report.

Its names are imported on first use (PEP 562): a reader actor unpickles its source from
:mod:`hpsray.pipelines.sources`, and importing this package must not import the trainer (torch)
into that process (docs/operations.md: The start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpsray.lazy import lazy_exports

if TYPE_CHECKING:
    from hpsray.pipelines.edge import BoundedEdge
    from hpsray.pipelines.pipeline import Pipeline
    from hpsray.pipelines.settings import (
        CheckpointSettings,
        MemPSSettings,
        SSDPSSettings,
        SyncSettings,
        TrainerSettings,
    )
    from hpsray.pipelines.sources import FileSource, SyntheticSource

__all__ = [
    "BoundedEdge",
    "CheckpointSettings",
    "FileSource",
    "MemPSSettings",
    "Pipeline",
    "SSDPSSettings",
    "SyncSettings",
    "SyntheticSource",
    "TrainerSettings",
]

_HOMES = {
    "BoundedEdge": "hpsray.pipelines.edge",
    "Pipeline": "hpsray.pipelines.pipeline",
    "FileSource": "hpsray.pipelines.sources",
    "SyntheticSource": "hpsray.pipelines.sources",
    "CheckpointSettings": "hpsray.pipelines.settings",
    "MemPSSettings": "hpsray.pipelines.settings",
    "SSDPSSettings": "hpsray.pipelines.settings",
    "SyncSettings": "hpsray.pipelines.settings",
    "TrainerSettings": "hpsray.pipelines.settings",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
