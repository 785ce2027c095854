"""hpsray: a hierarchical (HBM / host memory / SSD) parameter server on Ray for CTR models.

The public API; see the README for a tour. Its names are imported on first use (PEP 562), so a
process that needs only part of hpsray (a MEM-PS or SSD-PS actor, a reader) does not import
torch: every actor process of a pipeline imports ``hpsray`` first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpsray.lazy import lazy_exports
from hpsray.version import __version__

if TYPE_CHECKING:
    from hpsray.config import TrainConfig
    from hpsray.data import Batch, PlantedCTR
    from hpsray.models import DNN, auc, logloss
    from hpsray.reference import ReferenceTrainer

__all__ = ["DNN", "Batch", "PlantedCTR", "ReferenceTrainer", "TrainConfig", "__version__", "auc", "logloss"]

_HOMES = {
    "TrainConfig": "hpsray.config",
    "Batch": "hpsray.data",
    "PlantedCTR": "hpsray.data",
    "DNN": "hpsray.models",
    "auc": "hpsray.models",
    "logloss": "hpsray.models",
    "ReferenceTrainer": "hpsray.reference",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
