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

import hpsray.training.engine as engine_module
from hpsray.training.step import ArenaStep


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", PATHS)
def test_every_path_stays_within_its_budget(name, optimizer):
    go, _ = path(name, optimizer)
    tally(go).check(LAUNCHES[name], HOST_READS.get(name, 0))


def _inject(monkeypatch, fault) -> None:
    """``fault(arena, grads)`` runs inside every mini-batch's sparse update, beside the fused op
    (``ArenaStep.apply``, one node; ``grads`` the pooled gradient there) or the unfused update."""
    update, apply = ArenaStep.update, ArenaStep.apply

    def faulty(self, slots, gathered, grads, step):
        fault(self, grads)
        return update(self, slots, gathered, grads, step)

    def faulty_apply(self, mb, gathered, pooled, step):
        if self.fused:
            fault(self, pooled.grad)
        return apply(self, mb, gathered, pooled, step)

    monkeypatch.setattr(ArenaStep, "update", faulty)
    monkeypatch.setattr(ArenaStep, "apply", faulty_apply)


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


def test_the_fused_sparse_update_is_one_launch_of_a_one_node_minibatch():
    """One node steps with the fused op on the CPU: one ``hpsray::fused_sparse_update`` a
    mini-batch, counted as a launch, in place of the row gradients' bag sum, the optimizer's
    element-wise ops and the copy back (its numba kernel inside it is not a numba call)."""
    go, _ = path("local", "adam")
    counts = tally(go)
    counts.check(LAUNCHES["local"])
    for m in counts.minibatches:
        assert m.launches.count("hpsray::fused_sparse_update") == 1, m.launches
        assert "aten::index_copy_" not in m.launches and "aten::embedding_bag" in m.launches, m.launches


class _Unfused(ArenaStep):
    def __init__(self, arena, dim, optimizer, fused=None, row_lr=None):
        super().__init__(arena, dim, optimizer, fused=False, row_lr=row_lr)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_node_without_the_fused_op_stays_within_its_budget(monkeypatch, optimizer):
    """The unfused sparse update (the CUDA default), on the CPU twin: its own budget, no
    read-back, numba call or sort; over the fused path's budget (the check tells them apart)."""
    monkeypatch.setattr(engine_module, "ArenaStep", _Unfused)
    go, _ = path("local", optimizer)
    counts = tally(go)
    counts.check(LAUNCHES["local_unfused"])
    assert "aten::index_copy_" in counts.worst("launches")
    if optimizer != "sgd":
        with pytest.raises(AssertionError, match="launching ops in a mini-batch, budget"):
            counts.check(LAUNCHES["local"])
