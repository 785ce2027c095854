"""The job file of ``hpsray train``: TOML → validated, typed sections → what they build.

* :mod:`~hpsray.job.validate` — reading one TOML table with checks that name file and key;
* :mod:`~hpsray.job.sections` — one dataclass per section and the function that reads it;
* :mod:`~hpsray.job.jobconfig` — :class:`JobConfig`: load, validate, the :class:`~hpsray.config.TrainConfig`;
* :mod:`~hpsray.job.build` — sources, stages and the :class:`~hpsray.pipelines.Pipeline` of a job
  (the only importer of :mod:`hpsray.pipelines`; import it explicitly: it brings in Ray).
"""

from hpsray.job.jobconfig import JobConfig
from hpsray.job.sections import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    ModelSection,
    OptimizerSection,
    PipelineSection,
    SyntheticSection,
    TiersSection,
)

__all__ = [
    "CheckpointSection",
    "ClusterSection",
    "DataSection",
    "JobConfig",
    "ModelSection",
    "OptimizerSection",
    "PipelineSection",
    "SyntheticSection",
    "TiersSection",
]
