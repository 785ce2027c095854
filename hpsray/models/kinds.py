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
from hpsray.models.dcn import DCN, STRUCTURES
from hpsray.models.deepfm import DeepFM, WideDeep
from hpsray.models.dlrm import DLRM
from hpsray.models.dnn import DNN

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
        lambda s, d, n, seed, hidden: DNN(s, d, n, hidden, seed=seed),
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
}
MODEL_KINDS = tuple(KINDS)
"""The kinds ``[model] kind`` takes."""


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

    def build(self, n_slots: int, dim: int, n_dense: int, seed: int) -> nn.Module:
        """The module, its weights drawn from ``seed`` alone."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return KINDS[self.kind].build(n_slots, dim, n_dense, seed, **self.settings)

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
    reference and serving build alike."""
    return model_spec(config).build(n_slots, config.dim, n_dense, config.seed)


def _near(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
