"""What continuing a node's training exactly needs, in a checkpoint's file (docs/architecture.md:
Checkpoints): the dense weights and optimizer state of every replica, the mini-batch step, the
examples and losses so far, and torch's random state. The working set is not in it: a
checkpoint follows a flush, so the owners hold every row."""

from __future__ import annotations

import os

import torch

from hpsray.training.engine import TrainerEngine

__all__ = ["dense_state", "load_state", "save_state"]


def dense_state(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """The dense model's parameters on the host (replica 0; all replicas are equal)."""
    return {k: v.detach().cpu().clone() for k, v in engine.dense.models[0].state_dict().items()}


def save_state(engine: TrainerEngine, path: str) -> int:
    """Write ``engine``'s state to ``path``; returns the bytes written."""
    state = {
        "models": [m.state_dict() for m in engine.dense.models],
        "optimizers": [o.state_dict() for o in engine.dense.optimizers],
        "step": engine.step,
        "examples": engine.examples,
        "losses": dict(engine.losses),
        "rng": torch.get_rng_state(),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(state, path)
    return os.path.getsize(path)


def load_state(engine: TrainerEngine, path: str) -> int:
    """Continue from :func:`save_state`'s file; returns the step restored."""
    state = torch.load(path, map_location=engine.device.torch, weights_only=False)
    for model, saved in zip(engine.dense.models, state["models"], strict=True):
        model.load_state_dict(saved)
    for optimizer, saved in zip(engine.dense.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    engine.step, engine.examples = int(state["step"]), int(state["examples"])
    engine.losses = dict(state["losses"])
    torch.set_rng_state(state["rng"])
    return engine.step
