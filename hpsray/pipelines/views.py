"""The pipeline as its parts see it: one protocol per part, naming what that part reads of the
:class:`~hpsray.pipelines.Pipeline` (so that a part imports no pipeline, and the CLI's checks none
of the pipeline's modules: this module imports nothing at run time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from hpsray.config import TrainConfig
    from hpsray.data.batch import Batch
    from hpsray.pipelines.settings import CheckpointSettings, MemPSSettings, SSDPSSettings, TrainerSettings
    from hpsray.pipelines.sources import PipelineSource

__all__ = ["Evaluated", "PipelineView", "Placed", "Preflighted"]


class PipelineView(Protocol):
    """What every part reads: the source, the model's config, the batch size and the settings of
    the tiers and the trainers."""

    @property
    def source(self) -> PipelineSource: ...
    @property
    def config(self) -> TrainConfig: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def mem_settings(self) -> MemPSSettings: ...
    @property
    def ssd_settings(self) -> SSDPSSettings: ...
    @property
    def trainer_settings(self) -> TrainerSettings: ...


class Placed(PipelineView, Protocol):
    """What placement reads (:mod:`~hpsray.pipelines.placement`): also the actors' name prefix,
    the model's slots and the transforms a reader applies."""

    @property
    def name(self) -> str: ...
    @property
    def model_slots(self) -> int: ...
    @property
    def transforms(self) -> list[Callable[[Batch], Batch]]: ...


class Preflighted(PipelineView, Protocol):
    """What the checks before the first ``fit()`` read (:mod:`~hpsray.pipelines.preflight`): also
    the read queue, the node count, and the checkpoints' settings and fingerprint."""

    @property
    def read_queue(self) -> int: ...
    @property
    def n_nodes(self) -> int | None: ...
    @property
    def checkpoint_settings(self) -> CheckpointSettings | None: ...
    @property
    def fingerprint(self) -> str: ...


class Evaluated(Placed, Protocol):
    """What an evaluation reads (:mod:`~hpsray.pipelines.passes`): placement's view (to start its
    reader), where checkpoints go, and the trained model."""

    @property
    def checkpoint_settings(self) -> CheckpointSettings | None: ...
    def export_rows(self) -> tuple[np.ndarray, np.ndarray]: ...
    def dense_state(self) -> dict[str, Any]: ...
