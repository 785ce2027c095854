"""Typed configuration: :class:`TrainConfig` (shared by the reference trainer and the distributed
system) and the one set of choices a job may name (optimizers, devices, consistency modes).

The TOML job file of ``hpsray train`` is :mod:`hpsray.job`; its errors are
:class:`~hpsray.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpsray.admission_rules import check_admission
from hpsray.kernels import DEVICES
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SPARSE_OPTIMIZERS, SparseOptimizer, make_optimizer
from hpsray.tables import Tables, TableSpec, mixed_layouts, table_layouts

__all__ = [
    "CONSISTENCY_MODES",
    "DENSE_OPTIMIZERS",
    "DENSE_SYNC",
    "DEVICES",
    "PROPAGATIONS",
    "SPARSE_OPTIMIZERS",
    "TrainConfig",
    "check_admission",
]

DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
"""Optimizers of the replicated dense model (:func:`~hpsray.models.make_dense_optimizer`)."""
CONSISTENCY_MODES = ("bsp", "ssp", "absp", "asp")
"""How the trainers of several nodes stay consistent (see docs/architecture.md, "Consistency")."""
PROPAGATIONS = ("push", "pull", "relay")
"""How relaxed-consistency updates travel between trainers (:mod:`hpsray.cluster.consistency`)."""
DENSE_SYNC = ("allreduce", "chunked")
"""How dense gradients are summed over nodes: the collective group, or PHub-style chunks."""
# DEVICES = ("cpu", "cuda"): where the tables and the model live, from hpsray.kernels (its backends).


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: model shape, optimizers, mini-batch size, seed.

    Attributes:
        dim: embedding width per key.
        hidden: MLP widths of the :class:`~hpsray.models.DNN`.
        sparse_optimizer: one of :data:`SPARSE_OPTIMIZERS` (rows, in the tables).
        sparse_lr: learning rate of the sparse optimizer.
        dense_optimizer: one of :data:`DENSE_OPTIMIZERS` (replicated MLP weights, PyTorch).
        dense_lr: learning rate of the dense optimizer.
        minibatch_size: examples per gradient step.
        init_scale: new rows' weights are uniform in ``[-init_scale, init_scale)``.
        seed: seeds row initialisation and model weights.
        sparse_params: the sparse optimizer's own parameters (betas, eps, ...).
        model_kind: the dense model, one of :data:`hpsray.models.kinds.MODEL_KINDS`
            (:func:`hpsray.models.kinds.build_model`); ``"mlp"`` is the paper's DNN over ``hidden``.
        model_settings: that kind's settings (``[model]`` keys of a job file; checked when built).
        tables: the embedding tables (:class:`~hpsray.tables.TableSpec`); empty: one table of
            every slot at ``dim`` with this optimizer and sum pooling. ``dim``, ``row_width``,
            ``optimizer()`` and ``row_init()`` are that default table's; :meth:`tables_for` gives
            the resolved set.
    """

    dim: int = 16
    hidden: tuple[int, ...] = (512, 256, 128)
    sparse_optimizer: str = "adagrad"
    sparse_lr: float = 0.05
    dense_optimizer: str = "adam"
    dense_lr: float = 1e-3
    minibatch_size: int = 1024
    init_scale: float = 0.01
    seed: int = 0
    sparse_params: dict = field(default_factory=dict)
    model_kind: str = "mlp"
    model_settings: dict = field(default_factory=dict)
    tables: tuple[TableSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"TrainConfig.dim must be >= 1, got {self.dim}")
        if self.minibatch_size < 1:
            raise ValueError(f"TrainConfig.minibatch_size must be >= 1, got {self.minibatch_size}")
        if self.init_scale < 0:
            raise ValueError(f"TrainConfig.init_scale must be >= 0, got {self.init_scale}")
        object.__setattr__(self, "hidden", tuple(self.hidden))
        object.__setattr__(self, "tables", tuple(self.tables))
        for i, spec in enumerate(self.tables):
            if not isinstance(spec, TableSpec):
                raise TypeError(f"TrainConfig.tables[{i}] must be a TableSpec, got {type(spec).__name__}")
        self.optimizer()  # validates name and parameters

    def optimizer(self) -> SparseOptimizer:
        """The sparse optimizer this config names."""
        return make_optimizer(self.sparse_optimizer, lr=self.sparse_lr, **self.sparse_params)

    @property
    def row_width(self) -> int:
        """Floats per stored row: weights plus optimizer state; with ``tables``, the widest
        table's (tables of several layouts share rows of that width: docs/tables.md)."""
        if self.tables:
            return max(w for _, w, _ in table_layouts(self))
        return self.dim + self.optimizer().state_width(self.dim)

    @property
    def row_dim(self) -> int:
        """Weights per stored row: ``dim``, or with ``tables`` the widest table's dim."""
        return max(d for d, _, _ in table_layouts(self)) if self.tables else self.dim

    def row_init(self) -> RowInit:
        """How new rows are initialised: with ``tables`` of one layout, that layout's; of
        several, each key's by its table (``RowInit.tables``)."""
        if not self.tables:
            return RowInit.for_optimizer(self.dim, self.optimizer(), scale=self.init_scale, seed=self.seed)
        layouts = table_layouts(self)
        if not mixed_layouts(self):
            dim, _, opt = layouts[0]
            return RowInit.for_optimizer(dim, opt, scale=self.init_scale, seed=self.seed)
        return RowInit(
            dim=max(d for d, _, _ in layouts),
            scale=self.init_scale,
            seed=self.seed,
            tables=tuple((d, w, float(opt.state_init())) for d, w, opt in layouts),
        )

    def tables_for(self, n_slots: int) -> Tables:
        """The resolved :class:`~hpsray.tables.Tables` of ``n_slots`` slots (raises
        :class:`~hpsray.errors.ConfigError` naming the table and field of a bad one)."""
        return Tables.of(self, n_slots)
