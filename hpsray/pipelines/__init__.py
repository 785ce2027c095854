"""The pipeline composition API: stages joined by bounded object-ref queues, scheduling,
metrics and the run report."""

from hpsray.pipelines.edge import BoundedEdge
from hpsray.pipelines.pipeline import Pipeline, TrainingStopped
from hpsray.pipelines.sources import FileSource, SyntheticSource
from hpsray.pipelines.stages import CheckpointStage, MemPSStage, SSDPSStage, SyncStage, TrainerStage

__all__ = [
    "BoundedEdge",
    "CheckpointStage",
    "FileSource",
    "MemPSStage",
    "Pipeline",
    "SSDPSStage",
    "SyncStage",
    "SyntheticSource",
    "TrainerStage",
    "TrainingStopped",
]
