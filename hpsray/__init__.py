"""hpsray: a hierarchical (HBM / host memory / SSD) parameter server on Ray for CTR models.

The public API; see the README for a tour.
"""

from hpsray.config import TrainConfig
from hpsray.data import Batch, PlantedCTR
from hpsray.models import DNN, auc, logloss
from hpsray.reference import ReferenceTrainer
from hpsray.version import __version__

__all__ = ["DNN", "Batch", "PlantedCTR", "ReferenceTrainer", "TrainConfig", "__version__", "auc", "logloss"]
