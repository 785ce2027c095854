"""Every training path keeps each mini-batch within its budget: launching ops, no read-back,
no numba call, no sort (docs/architecture.md: One training step, Budgets). Each guard is shown
failing on the fault it guards against: a read-back, a numba call and a sort injected into a
mini-batch. Counted on the CPU, the twin of a CUDA device (``budget.py``); on a GPU the same
paths run under torch's sync debug mode (``test_device_syncs.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from budget import HOST_READS, LAUNCHES, tally  # tests/training/budget.py
from paths import OPTIMIZERS, PATHS, path  # tests/training/paths.py

from hpsray.training.step import ArenaStep


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", PATHS)
def test_every_path_stays_within_its_budget(name, optimizer):
    go, _ = path(name, optimizer)
    tally(go).check(LAUNCHES[name], HOST_READS.get(name, 0))


def _inject(monkeypatch, fault) -> None:
    """``fault(grads)`` runs inside every mini-batch's sparse update."""
    update = ArenaStep.update

    def faulty(self, slots, gathered, grads, step):
        fault(self, grads)
        return update(self, slots, gathered, grads, step)

    monkeypatch.setattr(ArenaStep, "update", faulty)


FAULTS = {
    "item": (lambda arena, g: g.sum().item(), "reads back"),
    "tolist": (lambda arena, g: g[:1].tolist(), "reads back"),
    "bool": (lambda arena, g: bool((g > 1e9).any()), "reads back"),
    "mask": (lambda arena, g: g[g > 0], "reads back"),
    "cpu": (lambda arena, g: g.cpu(), "reads back"),
    "sort": (lambda arena, g: torch.sort(g[:, 0]), "sorts"),
    "unique": (lambda arena, g: torch.unique(arena.arena[:4, 0]), "reads back"),
}


@pytest.mark.parametrize(
    ("name", "fault"),
    [("local", f) for f in sorted(FAULTS)] + [(p, f) for p in ("bsp", "devices") for f in ("item", "sort")],
)
def test_the_budget_check_fails_on_a_read_back_or_sort_in_a_minibatch(monkeypatch, name, fault):
    go, _ = path(name, "adagrad")
    inject, message = FAULTS[fault]
    _inject(monkeypatch, inject)
    with pytest.raises(AssertionError, match=message):
        tally(go).check(LAUNCHES[name])


@pytest.mark.parametrize("name", ["local", "bsp"])
def test_the_budget_check_fails_on_a_numba_call_in_a_minibatch(monkeypatch, name):
    go, strategies = path(name, "adagrad")
    engine = strategies[0].engine
    key = np.asarray(engine.hbm.tables[0].keys())[:1]  # resident: a probe of the table finds it
    _inject(monkeypatch, lambda arena, g: engine.hbm.get(key))
    with pytest.raises(AssertionError, match="calls numba"):
        tally(go).check(LAUNCHES[name])


def test_the_budget_check_fails_on_launches_over_budget(monkeypatch):
    go, _ = path("local", "sgd")
    _inject(monkeypatch, lambda arena, g: [g.add(1.0) for _ in range(20)])
    with pytest.raises(AssertionError, match="launching ops in a mini-batch, budget"):
        tally(go).check(LAUNCHES["local"])


def test_a_run_without_minibatches_fails_the_check():
    with pytest.raises(AssertionError, match="no mini-batch ran"):
        tally(lambda: None).check(LAUNCHES["local"])


def test_the_host_step_budget_fails_when_exceeded():
    """A relaxed mode's publish reads back on purpose, counted apart, and within its own budget."""
    go, _ = path("ssp", "sgd")
    with pytest.raises(AssertionError, match="host reads in a mini-batch's host step"):
        tally(go).check(LAUNCHES["ssp"], host_reads=0)
