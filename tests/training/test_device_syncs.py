"""Every training path's mini-batches make no device sync, without Ray: on a GPU they run under
``torch.cuda.set_sync_debug_mode("error")`` (``hpsray.training.marks.syncs_are_errors``: on inside
each mini-batch, off in the stated host steps), so any read-back there raises; on the CPU the
same paths run the op and read-back count of ``budget.py`` (docs/architecture.md: Budgets).
``benchmarks/gpu_check`` runs the ``gpu`` cases on a machine without Ray."""

from __future__ import annotations

import math

import pytest
import torch
from budget import HOST_READS, LAUNCHES, tally  # tests/training/budget.py
from paths import PATHS, path  # tests/training/paths.py

from hpsray.training.marks import syncs_are_errors
from hpsray.training.step import ArenaStep

from gpus import DEVICES, needs_cuda  # tests/gpus.py


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PATHS)
def test_no_minibatch_of_any_path_syncs_with_the_device(name, device):
    go, strategies = path(name, "adagrad_row", device)
    if device == "cuda":
        with syncs_are_errors():
            go()
        torch.cuda.synchronize()
    else:
        tally(go).check(LAUNCHES[name], HOST_READS.get(name, 0))
    for steps in strategies:
        assert steps.engine.step > 0
        assert all(math.isfinite(v) for v in steps.engine.losses.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["local", "bsp"])
def test_no_minibatch_syncs_when_the_read_stage_made_the_index(name, device):
    """``index_stage = "read"`` (the default on a GPU node's cores): the batch's layout comes
    made over positions and the trainer maps it to its slots; its mini-batches are the same."""
    go, strategies = path(name, "adam", device, layouts=True)
    if device == "cuda":
        with syncs_are_errors():
            go()
        torch.cuda.synchronize()
    else:
        tally(go).check(LAUNCHES[name], HOST_READS.get(name, 0))
    assert all(steps.engine.step > 0 for steps in strategies)


@pytest.mark.gpu
@needs_cuda
def test_a_read_back_in_a_minibatch_raises_on_the_gpu(monkeypatch):
    """The guard fails on its fault: one ``.item()`` in the sparse update."""
    go, _ = path("local", "adagrad", "cuda")
    update = ArenaStep.update

    def reads_back(self, slots, gathered, grads, step):
        grads.sum().item()
        return update(self, slots, gathered, grads, step)

    monkeypatch.setattr(ArenaStep, "update", reads_back)
    with syncs_are_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        go()
    torch.cuda.set_sync_debug_mode(0)
