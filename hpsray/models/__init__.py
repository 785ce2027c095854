"""CTR models over pooled embeddings, pooling, dense optimizers and metrics."""

from hpsray.models.dnn import DNN, make_dense_optimizer
from hpsray.models.metrics import auc, logloss
from hpsray.models.pooling import BagLayout, pool_sum

__all__ = ["DNN", "BagLayout", "auc", "logloss", "make_dense_optimizer", "pool_sum"]
