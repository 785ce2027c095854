"""The model kinds a job names (``[model] kind``): each kind's settings, checked, and the module
built from them. ``fit(model=...)`` takes any module of the same signature; these are its built-ins.

Every kind is ``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``, has the
attributes ``n_slots``, ``dim`` and ``n_dense`` (serving checks a request's shape against them) and draws
its weights from ``seed`` alone (not from the global torch RNG), so every replica, the reference
and a served copy start identical.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpsray.config import TrainConfig
from hpsray.errors import ConfigError
from hpsray.first_order import FIRST_ORDER_KINDS
from hpsray.models.dcn import DCN, STRUCTURES
from hpsray.models.deepfm import DeepFM, WideDeep
from hpsray.models.dlrm import DLRM
from hpsray.models.dnn import DNN
from hpsray.tables import Tables, with_first_order

_WIDTHS = "a list of integers >= 1"


def _widths(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in value
    )


def _rank(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class _Kind:
    defaults: dict[str, Any]
    checks: dict[str, tuple[Callable[[Any], bool], str]]
    build: Callable[..., nn.Module]  # (n_slots, dim, n_dense, seed, **settings), under a seeded RNG


def _unseeded(module: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A module class that draws from the global RNG (seeded by :meth:`ModelSpec.build`)."""
    return lambda n_slots, dim, n_dense, seed, **settings: module(n_slots, dim, n_dense, **settings)


KINDS: dict[str, _Kind] = {
    "mlp": _Kind(
        {"hidden": (512, 256, 128)},
        {"hidden": (_widths, _WIDTHS)},
        lambda s, d, n, seed, hidden, slot_dims=None: DNN(s, d, n, hidden, seed=seed, slot_dims=slot_dims),
    ),
    "dlrm": _Kind(
        {"bottom": (512, 256), "top": (512, 256)},
        {"bottom": (_widths, _WIDTHS), "top": (_widths, _WIDTHS)},
        _unseeded(DLRM),
    ),
    "dcn": _Kind(
        {"cross_layers": 3, "low_rank": None, "structure": "stacked", "hidden": (512, 256)},
        {
            "cross_layers": (_count, "an integer >= 0"),
            "low_rank": (_rank, "an integer >= 1 (or absent: full rank)"),
            "structure": (lambda v: v in STRUCTURES, " or ".join(f'"{s}"' for s in STRUCTURES)),
            "hidden": (_widths, _WIDTHS),
        },
        _unseeded(DCN),
    ),
    "deepfm": _Kind({"hidden": (400, 400, 400)}, {"hidden": (_widths, _WIDTHS)}, _unseeded(DeepFM)),
    "wide_deep": _Kind({"hidden": (1024, 512, 256)}, {"hidden": (_widths, _WIDTHS)}, _unseeded(WideDeep)),
    # deepfm and wide_deep take the keys' first-order rows as copied slots (hpsray.first_order)
}
MODEL_KINDS = tuple(KINDS)
"""The kinds ``[model] kind`` takes."""
MIXED_DIMS = ("mlp", "dcn")
"""The kinds that take slots of several widths (tables of their own dims, :mod:`hpsray.tables`):
those that flatten the slots. DLRM's dot interaction and DeepFM's / Wide & Deep's per-slot
factors need one width for every slot (TorchRec's rule for DLRM too)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model kind and its settings (those not given take the kind's defaults).

    Raises :class:`~hpsray.errors.ConfigError` (``where`` = ``"ModelSpec"``; a job file's parser
    names its file instead) naming the kind and the setting for an unknown
    kind, an unknown setting (with the nearest known name) or a value of the wrong shape.
    """

    kind: str = "mlp"
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                "ModelSpec",
                "model.kind",
                f"unknown kind {self.kind!r}{_near(self.kind, KINDS)}; one of {', '.join(KINDS)}",
            )
        kind = KINDS[self.kind]
        for name, value in self.settings.items():
            if name not in kind.checks:
                raise ConfigError(
                    "ModelSpec",
                    f"model.{name}",
                    f"not a setting of kind {self.kind!r}{_near(name, kind.checks)}; "
                    f"its settings: {', '.join(kind.checks)}",
                )
            check, want = kind.checks[name]
            if not check(value):
                raise ConfigError("ModelSpec", f"model.{name}", f"must be {want} for kind {self.kind!r}, got {value!r}")
        merged = {**kind.defaults, **self.settings}
        object.__setattr__(self, "settings", {k: tuple(v) if isinstance(v, list) else v for k, v in merged.items()})

    def build(
        self,
        n_slots: int,
        dim: int,
        n_dense: int,
        seed: int,
        slot_dims: tuple[int, ...] | None = None,
        first_order: int = 0,
    ) -> nn.Module:
        """The module, its weights drawn from ``seed`` alone; ``slot_dims`` (each slot's width,
        for the kinds of :data:`MIXED_DIMS` and of first-order rows only) when the slots' widths
        differ; ``first_order``: the last slots of ``n_slots`` that are first-order rows (the
        kinds of :data:`~hpsray.first_order.FIRST_ORDER_KINDS` need them, the others take none)."""
        extra: dict[str, Any] = {}
        if (self.kind in FIRST_ORDER_KINDS) != (first_order > 0):
            raise ConfigError(
                "ModelSpec", "model.kind", f"{self.kind!r} takes {first_order} first-order slots (hpsray.first_order)"
            )
        if first_order:
            extra["first_order"] = first_order
        if slot_dims is not None:
            if self.kind not in MIXED_DIMS and not first_order:
                raise ConfigError("ModelSpec", "model.kind", f"{self.kind!r} needs one dim for every slot")
            extra["slot_dims"] = tuple(slot_dims)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return KINDS[self.kind].build(n_slots, dim, n_dense, seed, **self.settings, **extra)

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., **settings}`` with lists: what an export records."""
        return {"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.settings.items()}}

    @classmethod
    def from_dict(cls, recorded: Mapping[str, Any]) -> ModelSpec:
        """The inverse of :meth:`to_dict`."""
        rest = {k: v for k, v in recorded.items() if k != "kind"}
        return cls(str(recorded.get("kind", "mlp")), rest)


def model_spec(config: TrainConfig) -> ModelSpec:
    """The kind and settings ``config`` names; ``"mlp"`` takes ``config.hidden`` unless its
    settings give ``hidden``."""
    settings = dict(config.model_settings)
    if config.model_kind == "mlp":
        settings.setdefault("hidden", config.hidden)
    return ModelSpec(config.model_kind, settings)


def build_model(config: TrainConfig, n_slots: int, n_dense: int) -> nn.Module:
    """The dense model ``config`` names, for ``n_slots`` slots of width ``config.dim`` and
    ``n_dense`` dense features, its weights drawn from ``config.seed``: what the trainers, the
    reference and serving build alike.

    With ``config.tables`` each slot has its table's width: one width for every slot builds the
    model at that width (input ``[B, n_slots, dim]``); several widths build the kinds of
    :data:`MIXED_DIMS` over ``[B, sum of the slots' widths]`` and refuse the others with a
    :class:`~hpsray.errors.ConfigError` naming the tables and their dims."""
    spec = model_spec(config)
    config = with_first_order(config, n_slots)
    if not config.tables:
        return spec.build(n_slots, config.dim, n_dense, config.seed)
    tables = config.tables_for(n_slots)
    copies = int(tables.copy_of.size)
    if tables.uniform_dim is not None:
        return spec.build(tables.n_slots, tables.uniform_dim, n_dense, config.seed, first_order=copies)
    refusal = mixed_dims_refusal(spec.kind, tables)
    if refusal:
        raise ConfigError("ModelSpec", "model.kind", refusal)
    dim = max(tables.dims)
    return spec.build(tables.n_slots, dim, n_dense, config.seed, slot_dims=tables.slot_dims, first_order=copies)


def mixed_dims_refusal(kind: str, tables: Tables) -> str | None:
    """Why ``kind`` cannot take ``tables`` (``None`` when it can): the kinds outside
    :data:`MIXED_DIMS` need one dim for every slot (a first-order table's aside)."""
    primary = {tables.dims[t] for t in tables.slot_table[: tables.n_data_slots].tolist()}
    if tables.uniform_dim is not None or kind in MIXED_DIMS or len(primary) == 1:
        return None
    why = "its dot interaction pairs" if kind == "dlrm" else "its per-slot factors pair"
    return (
        f"{kind!r} needs one dim for every slot ({why} the slots' embeddings); the tables have "
        f"{tables.describe()}: give them one dim, or use kind {' or '.join(repr(k) for k in MIXED_DIMS)}"
    )


def _near(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
