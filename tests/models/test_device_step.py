"""The trainer's step on its device: one code path for the CPU and CUDA.

The CPU cases run everywhere and are the same lines a GPU runs (NumPy in place of CuPy, torch on
the CPU); the ``gpu`` cases need a real CUDA device with CuPy and numba-cuda and are skipped
elsewhere. The reference trainer decides every result.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.errors import ConfigError
from hpsray.kernels.arrays import distinct_inverse, to_host
from hpsray.models.device import StepDevice
from hpsray.models.dnn import DNN
from hpsray.models.step import DenseReplicas
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.hbm import HbmPS

from gpus import DEVICES, needs_cuda  # tests/gpus.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=3)
BATCH = 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 2), max_size=300), st.integers(0, 40))
def test_distinct_inverse_equals_numpy_unique(values, repeats):
    keys = np.array(values + values[:repeats], dtype=np.uint64)
    distinct, inverse = distinct_inverse(np, keys)
    expected, expected_inverse = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(distinct, expected)
    np.testing.assert_array_equal(inverse, expected_inverse.reshape(-1))
    np.testing.assert_array_equal(distinct[inverse], keys)
    assert inverse.dtype == np.int64


def train_like_a_trainer(device: str, cfg: TrainConfig, batches) -> tuple:
    """A node's step as :class:`~hpsray.actors.trainer.Trainer` runs it with one node: the
    batch's rows into HBM-PS, then per mini-batch the device step and the sparse update."""
    dev = StepDevice(device)
    ref_rows = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)  # only its row store: initial rows
    hbm = HbmPS(4 * BATCH * GEN.n_slots, cfg.row_width, cfg.row_init(), device=device)
    dense = DenseReplicas(
        DNN(GEN.n_slots, cfg.dim, GEN.n_dense, cfg.hidden, seed=cfg.seed), 1, cfg.dense_optimizer, cfg.dense_lr, dev
    )
    optimizer, step, losses = cfg.optimizer(), 0, []
    seen = {}
    for batch in batches:
        keys = np.unique(batch.keys)
        fresh = keys[[k not in seen for k in keys.tolist()]]
        if fresh.size:
            hbm.insert(fresh, ref_rows.store.peek(fresh))
            seen.update(dict.fromkeys(fresh.tolist()))
        for mb in batch.minibatches(cfg.minibatch_size):
            loss, gkeys, grads = dense.step(mb, lambda k: hbm.get(k, columns=cfg.dim))
            if device == "cuda":  # nothing of the step came back to the host
                assert loss.is_cuda and hasattr(gkeys, "__cuda_array_interface__")
                assert hasattr(grads, "__cuda_array_interface__")
            step += 1
            hbm.apply_gradients(gkeys, grads, optimizer, step)
            losses.append(loss)
    all_keys = np.array(sorted(seen), dtype=np.uint64)
    state = {k: v.detach().cpu() for k, v in dense.models[0].state_dict().items()}
    return all_keys, hbm.get(all_keys), state, float(torch.stack(losses).mean())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer,lr", [("adagrad", 0.05), ("adam", 0.01)])
def test_the_device_step_ends_where_the_reference_ends(device, optimizer, lr):
    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=250, sparse_optimizer=optimizer, sparse_lr=lr)
    batches = [GEN.generate(BATCH, start_row=i * BATCH) for i in range(4)]
    keys, rows, dense, loss = train_like_a_trainer(device, cfg, batches)
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    ref.fit(batches)
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    # the GPU sums in another order (atomics, cuBLAS): equal up to float rounding
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-4, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    assert np.isfinite(loss) and 0.0 < loss < 1.0


def test_a_cuda_trainer_on_a_node_without_gpus_is_refused_before_training(ray_local, tmp_path):
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings

    if any(n.get("Resources", {}).get("GPU", 0) for n in ray_local.nodes() if n.get("Alive")):
        pytest.skip("this Ray node has a GPU")
    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=250)
    with pytest.raises(ConfigError, match="offers no GPU"):
        with Pipeline(
            SyntheticSource(GEN, rows=2000),
            TrainerSettings(cfg, device="cuda"),
            MemPSSettings(capacity_rows=20000),
            batch_size=BATCH,
        ) as p:
            p.fit(progress=False)


def assert_like_the_reference(cfg, source, keys, rows, dense, atol: float) -> ReferenceTrainer:
    """A pipeline's exported rows and dense weights equal the reference trainer's on ``source``
    (rtol 1e-4); returns the trained reference."""
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, cfg)
    ref.fit(source.open(BATCH))
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-4, atol=atol)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-4, atol=atol, err_msg=name)
    return ref


# -- real GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_the_pipeline_on_cuda_is_lossless_with_ssd_spills(ray_local, tmp_path):
    from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, SyntheticSource, TrainerSettings

    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
    source = SyntheticSource(GEN, rows=6000)
    with Pipeline(
        source,
        TrainerSettings(cfg, device="cuda"),
        MemPSSettings(capacity_rows=3000),
        SSDPSSettings(str(tmp_path / "ssd"), options=dict(rows_per_file=256)),
        batch_size=BATCH,
    ) as p:
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
        evaluated = p.evaluate(SyntheticSource(GEN, rows=2000, start_row=10**7))
    assert report["examples"] == 6000 and report["ssd"]["bytes_read"] > 0
    ref = assert_like_the_reference(cfg, source, keys, rows, dense, atol=1e-5)
    ref_auc = ref.evaluate(SyntheticSource(GEN, rows=2000, start_row=10**7).open(BATCH)).auc
    assert abs(evaluated["auc"] - ref_auc) < 1e-3


def _nccl_gather(rank: int, world: int, group: str) -> dict:
    import cupy

    from hpsray.cluster.collective import CollectiveGroup

    g = CollectiveGroup(world, rank, group, backend="nccl")
    keys = cupy.arange(10 * rank, 10 * rank + 5 + rank, dtype=cupy.uint64) + cupy.uint64(2**63)
    grads = cupy.full((keys.size, 3), rank + 0.5, dtype=cupy.float32)
    all_keys, all_grads = g.allgather_sparse(keys, grads)
    total = g.allreduce_sum(torch.full((4,), float(rank + 1), device="cuda"))
    return {
        "on_device": isinstance(all_keys, cupy.ndarray) and isinstance(all_grads, cupy.ndarray),
        "keys": to_host(all_keys).tolist(),
        "grads": to_host(all_grads).tolist(),
        "total": total.cpu().tolist(),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "reduced_on": str(total.device),
    }


@pytest.mark.gpu
@needs_cuda
def test_the_nccl_group_gathers_sparse_updates_on_the_device(ray_local):
    """A NCCL group of one trainer per GPU (as many as the machine has, at most two): keys and
    gradients are gathered as device arrays, in rank order, and each trainer has its own GPU."""
    import ray

    # the workers cannot import this test module: ship the actor's code by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    world = min(2, torch.cuda.device_count())

    @ray.remote(num_gpus=1, num_cpus=0)
    class Rank:
        def run(self, rank, world, group):
            return _nccl_gather(rank, world, group)

    ranks = [Rank.remote() for _ in range(world)]
    out = ray.get([r.run.remote(i, world, "nccl-test") for i, r in enumerate(ranks)])
    expected_keys = [k + 2**63 for r in range(world) for k in range(10 * r, 10 * r + 5 + r)]
    for got in out:
        assert got["on_device"] and got["reduced_on"].startswith("cuda")
        assert got["keys"] == expected_keys
        assert got["grads"] == [[r + 0.5] * 3 for r in range(world) for _ in range(5 + r)]
        assert got["total"] == [float(sum(range(1, world + 1)))] * 4
    assert len({got["gpu"] for got in out}) == world, "two trainers share a GPU"


@pytest.mark.gpu
@needs_cuda
def test_hpsray_train_with_device_cuda(tmp_path):
    import ray  # noqa: F401  (the command runs the job on Ray: skipped, naming it, where Ray is absent)

    from hpsray.data.generate import to_toml

    job = {
        "data.synthetic": {"rows": 8000, "eval_rows": 2000, "slots": 4, "keys": 3000, "dense": 3, "seed": 5},
        "model": {"dim": 8, "hidden": [32]},
        "tiers": {"mem_rows": 6000},
        "pipeline": {"batch_size": 2000, "minibatch_size": 500, "device": "cuda"},
    }
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpsray",
            "train",
            str(path),
            "--report",
            str(tmp_path / "r.json"),
            "--export",
            str(tmp_path / "model"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["examples"] == 8000 and report["auc"] > 0.6
    compare = subprocess.run(
        [sys.executable, "-m", "hpsray", "train", str(path), "--reference", "--compare", str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert compare.returncode == 0, compare.stdout[-2000:] + compare.stderr[-2000:]


@pytest.mark.gpu
@needs_cuda
def test_two_device_processes_on_two_gpus_are_lossless(ray_local):
    """``n_devices = 2`` on CUDA: two trainer processes, one GPU each, in a NCCL device mesh
    (all-to-all of rows and gradients between the GPUs); the result is the reference's."""
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
    source = SyntheticSource(GEN, rows=4000)
    with Pipeline(
        source, TrainerSettings(cfg, n_devices=2, device="cuda"), MemPSSettings(capacity_rows=20000), batch_size=BATCH
    ) as p:
        p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    assert_like_the_reference(cfg, source, keys, rows, dense, atol=5e-5)
