"""The multilayer perceptron the model kinds share: ``Linear`` + ``ReLU`` per hidden width."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def mlp(width: int, hidden: Sequence[int], out: int | None = None) -> nn.Sequential:
    """``Linear(width, h) + ReLU`` for each ``h`` of ``hidden``, then ``Linear(., out)`` without an
    activation when ``out`` is given. Draws from the global torch RNG: callers seed it
    (:func:`seeded`)."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    if out is not None:
        layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers)


def out_width(width: int, hidden: Sequence[int]) -> int:
    """The width that :func:`mlp` (without ``out``) gives for input ``width``."""
    return hidden[-1] if len(hidden) else width
