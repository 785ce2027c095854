"""The fused sparse backward + optimizer op (``hpsray::fused_sparse_update``) against the
unfused torch ops, the kernels' own math and the reference trainer, bit for bit, for every
optimizer; its CUDA kernel under numba's simulator; its warm-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from paths import OPTIMIZERS, path  # tests/training/paths.py
from test_engine import N_DENSE, N_SLOTS, Owner, _batches, _train  # tests/training/test_engine.py

import hpsray.kernels.fused_update as cpu_kernels
import hpsray.training.engine as engine_module
from hpsray.config import TrainConfig
from hpsray.kernels.optim import apply_to_rows, make_optimizer
from hpsray.reference import ReferenceTrainer
from hpsray.training.engine import TrainerEngine
from hpsray.training.fused_update import fused_sparse_update, warm_fused_update
from hpsray.training.step import ArenaStep

from gpus import DEVICES  # tests/gpus.py

DIM = 5


def _case(optimizer: str, seed: int, n_rows: int = 300, n_bags: int = 120, nnz: int = 900):
    """An arena, a mini-batch's distinct slots and its occurrences grouped by row (bag order)."""
    opt = make_optimizer(optimizer, lr=0.05)
    rng = np.random.default_rng(seed)
    width = DIM + opt.state_width(DIM)
    arena = rng.standard_normal((2 * n_rows, width)).astype(np.float32)
    arena[:, DIM:] = np.abs(arena[:, DIM:])  # accumulators and second moments are >= 0
    rows = rng.permutation(2 * n_rows)[:n_rows].astype(np.int64)
    counts = rng.integers(1, 2 * nnz // n_rows, size=n_rows)
    offsets = np.r_[0, np.cumsum(counts)[:-1]].astype(np.int32)
    bags = np.concatenate([np.sort(rng.integers(0, n_bags, size=c)) for c in counts]).astype(np.int32)
    grad = (rng.standard_normal((n_bags, DIM)) * 10.0 ** rng.integers(-4, 2, size=(n_bags, 1))).astype(np.float32)
    return opt, arena, rows, bags, offsets, grad


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_fused_op_equals_the_kernels_math_and_the_unfused_ops_to_the_bit(optimizer):
    opt, arena, rows, bags, offsets, grad = _case(optimizer, seed=OPTIMIZERS.index(optimizer))
    # the definition: each row's bags summed in order from zero in float32, then apply_row_update
    ends = np.r_[offsets[1:], bags.size]
    summed = np.zeros((rows.size, DIM), np.float32)
    for u in range(rows.size):
        for b in bags[offsets[u] : ends[u]]:
            summed[u] += grad[b]
    expected = arena.copy()
    touched = expected[rows]
    apply_to_rows(touched, summed, opt, 3)
    expected[rows] = touched
    fused, unfused = torch.from_numpy(arena.copy()), torch.from_numpy(arena.copy())
    t = [torch.from_numpy(a) for a in (rows, bags, offsets, grad)]
    hp = [float(x) for x in opt.hyperparams(3)]
    fused_sparse_update(fused, *t, opt.kind, hp)
    step = ArenaStep(unfused, DIM, opt, fused=False)
    row_grads = torch.nn.functional.embedding_bag(t[1], t[3], t[2], mode="sum")
    step.update(t[0], step.gather(t[0]), row_grads, 3)
    np.testing.assert_array_equal(fused.numpy(), expected)
    np.testing.assert_array_equal(unfused.numpy(), expected)
    untouched = np.setdiff1d(np.arange(arena.shape[0]), rows)
    np.testing.assert_array_equal(fused.numpy()[untouched], arena[untouched])


class _Unfused(ArenaStep):
    """The trainer's arena step with the fused op off."""

    def __init__(self, arena: torch.Tensor, dim: int, optimizer, fused: bool | None = None, row_lr=None) -> None:
        super().__init__(arena, dim, optimizer, fused=False, row_lr=row_lr)


def _trained(optimizer: str, batches: int) -> tuple[np.ndarray, np.ndarray, dict, bool]:
    go, strategies = path("local", optimizer)
    for _ in range(batches - 1):
        go()
    engine = strategies[0].engine
    keys = np.sort(np.asarray(engine.hbm.tables[0].keys()))
    return keys, engine.rows(keys), engine.dense.models[0].state_dict(), engine.arena.fused


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_node_training_with_and_without_the_fused_op_gives_the_same_bits(monkeypatch, optimizer):
    """Two batches of two mini-batches each (the dense model follows the sparse rows, each
    mini-batch's rows feed the next's loss): the rows and the dense model equal bit for bit."""
    keys, rows, model, fused = _trained(optimizer, 2)
    monkeypatch.setattr(engine_module, "ArenaStep", _Unfused)
    keys_u, rows_u, model_u, fused_u = _trained(optimizer, 2)
    assert fused and not fused_u  # the CPU default is the fused op; the patched step is not
    np.testing.assert_array_equal(keys, keys_u)
    np.testing.assert_array_equal(rows, rows_u)
    for name, value in model.items():
        assert torch.equal(value, model_u[name]), name


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_node_with_the_fused_op_equals_the_reference_to_the_bit(optimizer):
    """Three batches through the owners (rows go back and come again): every row and the dense
    model as the reference trainer has them."""
    config = TrainConfig(dim=8, hidden=(16, 8), minibatch_size=64, sparse_optimizer=optimizer)
    batches = _batches(3, 200)
    reference = ReferenceTrainer(N_SLOTS, N_DENSE, config)
    for b in batches:
        reference.train_batch(b)
    engine, owner = TrainerEngine(config, N_SLOTS, N_DENSE, capacity=4000), Owner(config)
    _train(engine, owner, batches)
    assert engine.arena.fused
    keys, rows, state = reference.export()
    np.testing.assert_array_equal(np.stack([owner.rows[k] for k in keys.tolist()]), rows)
    model = engine.dense.models[0].state_dict()
    for name, value in state.items():
        assert torch.equal(model[name], value), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_op_on_a_device_equals_the_unfused_ops_there(optimizer, device):
    """The op as registered for the arena's device (on CUDA: the numba.cuda kernel on torch's
    stream) against the unfused ops on the same device: the same bits on the CPU; on a GPU the
    optimizer's FMA contraction may differ in the last bits."""
    opt, arena, rows, bags, offsets, grad = _case(optimizer, seed=30)
    dev = torch.device(device)
    fused, unfused = torch.from_numpy(arena.copy()).to(dev), torch.from_numpy(arena.copy()).to(dev)
    t = [torch.from_numpy(a).to(dev) for a in (rows, bags, offsets, grad)]
    step = ArenaStep(fused, DIM, opt, fused=True)
    leaf = t[3].view(-1, 1, DIM).clone().requires_grad_(True)
    leaf.grad = t[3].view(-1, 1, DIM).clone()

    class Mb:  # the fields of a MiniBatchIndex the update reads
        rows, grad_bags, grad_offsets = t[0], t[1], t[2]

    step.apply(Mb, step.gather(t[0]), leaf, 4)  # type: ignore[arg-type]
    plain = ArenaStep(unfused, DIM, opt, fused=False)
    plain.update(t[0], plain.gather(t[0]), torch.nn.functional.embedding_bag(t[1], t[3], t[2], mode="sum"), 4)
    if device == "cpu":
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused, torch.from_numpy(arena).to(dev))


def test_bad_arguments_are_a_clear_error():
    opt, arena, rows, bags, offsets, grad = _case("sgd", seed=9)
    t = [torch.from_numpy(a) for a in (arena, rows, bags, offsets, grad)]
    with pytest.raises(ValueError, match="grad_offsets torch.int64"):
        fused_sparse_update(t[0], t[1], t[2], t[3].long(), t[4], opt.kind, [0.1] * 6)
    with pytest.raises(ValueError, match=r"arena torch.float64\(600, 5\)"):
        fused_sparse_update(t[0].double(), t[1], t[2], t[3], t[4], opt.kind, [0.1] * 6)


def test_the_warm_up_compiles_what_a_minibatch_calls():
    """After :func:`warm_fused_update` a mini-batch's call compiles nothing new (numba's first
    call of a new signature compiles, or loads from the cache, inside the timed step)."""
    warm_fused_update()
    warmed = list(cpu_kernels.fused_rows_update.signatures)
    assert warmed
    go, _ = path("local", "adagrad")
    go()
    assert list(cpu_kernels.fused_rows_update.signatures) == warmed


_SIM = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from numba import cuda
    from hpsray.kernels.cuda.fused_update import k_fused_rows_update
    from hpsray.kernels.fused_update import fused_rows_update
    cases = json.loads(sys.argv[1])
    from numba import config
    out = {"simulator": bool(config.ENABLE_CUDASIM)}
    for kind, (arena, rows, bags, offsets, grad, hp) in cases.items():
        arena = np.array(arena, np.float32)
        args = (np.array(rows, np.int64), np.array(bags, np.int32), np.array(offsets, np.int32),
                np.array(grad, np.float32), int(kind), np.array(hp, np.float32))
        cpu, dev = arena.copy(), arena.copy()
        fused_rows_update(cpu, *args, 3)
        n = args[0].size
        k_fused_rows_update[(n + 7) // 8, 8](dev, *args)
        out[kind] = bool(np.array_equal(cpu, dev) and not np.array_equal(cpu, arena))
    print(json.dumps(out))
    """
)


def test_the_cuda_kernel_equals_the_cpu_kernel_under_the_simulator():
    """One thread per row on numba's CUDA simulator (a subprocess: the simulator must be on
    before numba.cuda is imported): the CPU kernel's bits for every optimizer."""
    cases = {}
    for name in OPTIMIZERS:
        opt, arena, rows, bags, offsets, grad = _case(name, seed=20, n_rows=20, n_bags=12, nnz=60)
        hp = [float(x) for x in opt.hyperparams(2)]
        cases[opt.kind] = [arena.tolist(), rows.tolist(), bags.tolist(), offsets.tolist(), grad.tolist(), hp]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SIM, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"simulator": True, **{str(k): True for k in range(4)}}, report


def test_the_fused_step_bench_runs_and_both_steps_end_with_the_same_rows(capsys):
    """``benchmarks/fused_step.py`` on tiny settings (its figures: docs/benchmarks.md)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_step.py"
    spec = importlib.util.spec_from_file_location("_fused_step_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--minibatch", "64", "--minibatches-per-batch", "2", "--batches", "1", "--keys-per-slot", "300"]
    args += ["--keys-per-example", "26", "--repeat", "1", "--json"]
    assert bench.main(args) == 0
    (figures,) = json.loads(capsys.readouterr().out)
    assert figures["same_rows"] and figures["minibatches"] == 2
    assert figures["fused_ms_per_minibatch"] > 0 and figures["update_unfused_ms"] > 0


def test_a_trainer_s_warm_up_does_not_import_torch_dynamo():
    """A ``torch.library.custom_op``'s kernels import TorchDynamo on their first call (~1 s of CPU
    in each trainer's start); the op is defined with the low-level verbs instead."""
    code = (
        "import sys; from hpsray.config import TrainConfig; from hpsray.tiers.hbm import HbmPS; "
        "from hpsray.tiers.warmup import warm_trainer_step; c = TrainConfig(dim=4, hidden=(8,)); "
        "warm_trainer_step(HbmPS(256, c.row_width, c.row_init(), 1, 1, 'cpu'), c.row_init(), c.row_width, 3, 2); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
