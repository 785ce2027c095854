"""``hpsray bench peers`` and its peers: each trains what the reference trainer trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpsray.bench import peers
from hpsray.bench.baselines import PeerSpec, Vocabulary, load_examples, save_examples, split
from hpsray.bench.baselines.plain_torch import PlainTorchTrainer, index_batch, minibatches
from hpsray.models.metrics import auc
from hpsray.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[2]
TORCHREC_VENV = Path(os.environ.get("HPSRAY_TORCHREC_VENV", REPO / "benchmarks" / ".torchrec-venv"))
TORCHREC_PYTHON = TORCHREC_VENV / "bin" / "python"


def tiny_spec(tmp_path, optimizer="adagrad", lr=0.05, **kw) -> PeerSpec:
    """3 slots (multi-hot: 7 keys per example), 60 keys per slot, a small MLP."""
    base = dict(
        system="test",
        data_dir=str(tmp_path / "data"),
        n_slots=3,
        keys_per_slot=60,
        keys_per_example=7,
        n_dense=2,
        dim=4,
        hidden=(16, 8),
        minibatch=128,
        batch=512,
        warmup_rows=512,
        rows=1536,
        eval_rows=1024,
        sparse_optimizer=optimizer,
        sparse_lr=lr,
        seed=3,
        result_path=str(tmp_path / "result.json"),
    )
    base.update(kw)
    return PeerSpec(**base)


def reference_on(spec: PeerSpec) -> ReferenceTrainer:
    """The reference trainer on ``spec``'s stored stream, in the peers' batch / mini-batch order."""
    ref = ReferenceTrainer(spec.n_slots, spec.n_dense, spec.train_config())
    ref.fit(split(load_examples(spec, "train"), spec.batch))
    return ref


@pytest.mark.parametrize("model", [{"kind": "dlrm", "bottom": [8], "top": [8]}, {"kind": "dcn", "low_rank": 2}])
def test_plain_torch_trains_the_reference_parameters_with_each_model_kind(tmp_path, model):
    spec = tiny_spec(tmp_path, model=model)
    save_examples(spec)
    ref = reference_on(spec)
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    pt = PlainTorchTrainer(vocab.initial_weights(spec), spec.n_slots, spec.n_dense, spec.train_config())
    pt.fit(minibatches(load_examples(spec, "train"), vocab, spec, 0, None))
    table, dense = pt.export()
    keys, rows, ref_dense = ref.export()
    np.testing.assert_allclose(table[vocab.index(keys)], rows[:, : spec.dim], atol=2e-5)
    assert dense.keys() == ref_dense.keys() and any("cross" in k or "bottom" in k for k in dense)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), atol=2e-5, err_msg=name)


def test_vocabulary_indexes_every_key_and_rejects_others():
    v = Vocabulary(4, 25)
    assert len(v) == 100
    np.testing.assert_array_equal(v.index(v.keys[::-1]), np.arange(100)[::-1])
    from hpsray.data.keys import hash_keys

    assert v.index(hash_keys(np.array([2]), np.array([7], np.uint64)))[0] == 2 * 25 + 7
    with pytest.raises(KeyError, match="not in the vocabulary"):
        v.index(np.array([12345], np.uint64))


@pytest.mark.parametrize("optimizer,lr", [("adagrad", 0.05), ("sgd", 0.1)])
def test_plain_torch_trains_the_reference_parameters(tmp_path, optimizer, lr):
    spec = tiny_spec(tmp_path, optimizer, lr)
    save_examples(spec)
    ref = reference_on(spec)
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    pt = PlainTorchTrainer(vocab.initial_weights(spec), spec.n_slots, spec.n_dense, spec.train_config())
    pt.fit(minibatches(load_examples(spec, "train"), vocab, spec, 0, None))
    assert pt.steps == ref.step
    table, dense = pt.export()
    keys, rows, ref_dense = ref.export()
    np.testing.assert_allclose(table[vocab.index(keys)], rows[:, : spec.dim], atol=2e-5)
    untouched = np.setdiff1d(np.arange(len(vocab)), vocab.index(keys))
    np.testing.assert_array_equal(table[untouched], vocab.initial_weights(spec)[untouched])
    for name, value in ref_dense.items():
        torch.testing.assert_close(dense[name], value, atol=2e-5, rtol=1e-4)
    held_out = load_examples(spec, "eval")
    p = np.concatenate([pt.predict(index_batch(mb, vocab)) for mb in held_out.minibatches(spec.minibatch)])
    assert auc(held_out.labels, p) == pytest.approx(ref.evaluate([held_out]).auc, abs=1e-4)


def test_plain_torch_sparse_adam_learns_like_the_reference(tmp_path):
    # torch.optim.SparseAdam adds eps to sqrt(v) before bias correction, hpsray's lazy Adam after
    # it: with gradients near eps the rows differ, so only the model quality is compared here
    spec = tiny_spec(tmp_path, "adam", 0.01)
    save_examples(spec)
    ref = reference_on(spec)
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    pt = PlainTorchTrainer(vocab.initial_weights(spec), spec.n_slots, spec.n_dense, spec.train_config())
    pt.fit(minibatches(load_examples(spec, "train"), vocab, spec, 0, None))
    assert type(pt.sparse).__name__ == "SparseAdam"
    held_out = load_examples(spec, "eval")
    p = np.concatenate([pt.predict(index_batch(mb, vocab)) for mb in held_out.minibatches(spec.minibatch)])
    assert auc(held_out.labels, p) == pytest.approx(ref.evaluate([held_out]).auc, abs=0.01)


def test_plain_torch_names_what_it_cannot_do(tmp_path):
    from hpsray.bench.baselines.plain_torch import sparse_optimizer

    with pytest.raises(ValueError, match="no sparse optimizer for 'adagrad_row'"):
        sparse_optimizer(tiny_spec(tmp_path, "adagrad_row").train_config(), [torch.zeros(2, 2, requires_grad=True)])


def test_sharded_ps_is_lossless_and_shards_by_owner(ray_local, tmp_path):
    import ray

    from hpsray.bench.baselines.sharded_ps import ShardedPS
    from hpsray.tiers.partition import owner_of

    spec = tiny_spec(tmp_path)
    save_examples(spec)
    ref = reference_on(spec)
    ps = ShardedPS(spec.train_config(), spec.n_slots, spec.n_dense, capacity=spec.vocabulary_rows, n_shards=3)
    try:
        refs = [ray.put(b) for b in split(load_examples(spec, "train"), spec.batch)]
        done = ps.fit(refs)
        assert done["examples"] == spec.warmup_rows + spec.rows and done["steps"] == ref.step
        keys, rows, dense = ps.export()
        ref_keys, ref_rows, ref_dense = ref.export()
        np.testing.assert_array_equal(keys, ref_keys)
        np.testing.assert_allclose(rows, ref_rows, atol=2e-5)
        for name, value in ref_dense.items():
            torch.testing.assert_close(dense[name], value, atol=2e-5, rtol=1e-4)
        for k, shard in enumerate(ps.shards):
            shard_keys, _ = ray.get(shard.export.remote())
            assert shard_keys.size and np.all(owner_of(shard_keys, 3) == k)
        held_out = load_examples(spec, "eval")
        got = ps.evaluate([ray.put(held_out)])
        assert got["auc"] == pytest.approx(ref.evaluate([held_out]).auc, abs=1e-4)
        assert got["auc"] > 0.6  # it learnt the planted model
    finally:
        ps.shutdown()


def test_ratios_and_the_issue_target():
    r = peers.ratios(
        {
            "hpsray_in_memory": {"examples_per_s": 120.0, "auc": 0.7801, "peak_rss_bytes": 4},
            "pytorch": {"examples_per_s": 100.0, "auc": 0.7800, "peak_rss_bytes": 2},
            "torchrec": {"skipped": "no venv"},
        }
    )
    assert r["hpsray_in_memory_vs_pytorch"] == pytest.approx(1.2)
    assert r["rss_hpsray_in_memory_vs_pytorch"] == pytest.approx(2.0)
    assert r["target_met"] is True and "hpsray_in_memory_vs_torchrec" not in r
    slower = peers.ratios(
        {
            "hpsray_in_memory": {"examples_per_s": 90.0, "auc": 0.78, "peak_rss_bytes": 1},
            "pytorch": {"examples_per_s": 100.0, "auc": 0.78, "peak_rss_bytes": 1},
        },
        ceiling={"examples_per_s": 120.0, "peak_rss_bytes": 1},
    )
    assert slower["target_met"] is False
    # the dense model alone bounds every system: the share of its time spent there
    assert slower["pytorch_vs_mlp_alone"] == pytest.approx(100 / 120)
    assert slower["hpsray_in_memory_vs_mlp_alone"] == pytest.approx(90 / 120)


def _bench(tmp_path, *extra) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "hpsray",
        "bench",
        "peers",
        "--json",
        "--keys-per-example",
        "26",
        "--keys",
        "2000",
        "--rows",
        "4096",
        "--warmup-rows",
        "2048",
        "--eval-rows",
        "2048",
        "--minibatch",
        "512",
        "--batch",
        "2048",
        "--ssd-batch",
        "512",
        "--ssd-mem-fraction",
        "0.05",
        "--hidden",
        "32,16",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_bench_peers_json_has_every_figure_of_every_system(tmp_path):
    report_dir = tmp_path / "report"
    got = _bench(tmp_path, "--report-dir", str(report_dir))
    run = got["by_keys_per_example"]["26"]
    systems = run["systems"]
    assert set(systems) == set(peers.SYSTEMS)
    for name, r in systems.items():
        if name == "torchrec" and not TORCHREC_PYTHON.exists():
            assert "torchrec_env.sh" in r["skipped"]
            continue
        assert "error" not in r, (name, r)
        for key in ("examples_per_s", "auc", "peak_rss_bytes"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (name, key, r)
        assert r["auc"] > 0.6, (name, r["auc"])  # every system learns the planted model
    # same model, data and optimizer: the same held-out AUC
    aucs = [r["auc"] for r in systems.values() if "auc" in r]
    assert max(aucs) - min(aucs) < 0.002
    # the small budget sends rows to SSD-PS and back
    assert systems["hpsray_ssd"]["ssd_bytes_read"] > 0 and systems["hpsray_in_memory"]["ssd_bytes_read"] == 0
    assert systems["sharded_ps"]["peak_rss_by_process"].keys() >= {"PSShard[0]", "PSShard[1]", "PSTrainer", "driver"}
    assert {
        "hpsray_in_memory_vs_pytorch",
        "hpsray_ssd_vs_pytorch",
        "hpsray_in_memory_vs_sharded_ps",
        "target_met",
        "pytorch_vs_mlp_alone",
        "hpsray_in_memory_vs_mlp_alone",
    } <= run["ratios"].keys()
    # the bound ran the same timed mini-batches as every system, through the same model
    bound = run["ceiling"]["mlp_alone"]
    assert bound["examples"] == systems["pytorch"]["examples"] == systems["hpsray_in_memory"]["examples"]
    assert bound["examples_per_s"] > 0 and bound["peak_rss_bytes"] > 0
    files = {Path(f).name for f in got["report_files"]}
    assert {
        "peers.md",
        "peers.json",
        "peers.examples_per_s.png",
        "hpsray_in_memory.26keys.json",
        "hpsray_in_memory.26keys.stage_times.png",
        "hpsray_ssd.26keys.ssd_io.png",
    } <= files
    assert all((report_dir / f).stat().st_size > 0 for f in files)
    assert "pipeline stages" in (report_dir / "peers.md").read_text()
    assert "| mlp_alone |" in (report_dir / "peers.md").read_text()


def test_torchrec_is_skipped_with_a_reason_without_its_environment(tmp_path):
    got = _bench(tmp_path, "--systems", "torchrec", "--torchrec-venv", str(tmp_path / "absent"))
    r = got["by_keys_per_example"]["26"]["systems"]["torchrec"]
    assert "skipped" in r and "torchrec_env.sh" in r["skipped"]


def check_torchrec_peer_trains_what_plain_torch_trains(tmp_path, spec: PeerSpec) -> dict:
    """Run the TorchRec peer on ``spec``; its table must equal plain PyTorch's after the same
    mini-batches, and its held-out AUC plain PyTorch's. Returns the peer's figures."""
    save_examples(spec)
    (tmp_path / "spec.json").write_text(spec.to_json())
    env = {**os.environ, "HPSRAY_TORCHREC_EXPORT": str(tmp_path / "table.npy")}
    out = subprocess.run(
        [str(TORCHREC_PYTHON), str(REPO / "benchmarks" / "torchrec_peer.py"), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(Path(spec.result_path).read_text())
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    pt = PlainTorchTrainer(vocab.initial_weights(spec), spec.n_slots, spec.n_dense, spec.train_config())
    pt.fit(minibatches(load_examples(spec, "train"), vocab, spec, 0, None))
    np.testing.assert_allclose(np.load(tmp_path / "table.npy"), pt.export()[0], atol=1e-4)
    held_out = load_examples(spec, "eval")
    p = np.concatenate([pt.predict(index_batch(mb, vocab)) for mb in held_out.minibatches(spec.minibatch)])
    assert result["auc"] == pytest.approx(auc(held_out.labels, p), abs=1e-3)
    return result


@pytest.mark.skipif(not TORCHREC_PYTHON.exists(), reason="no TorchRec environment (bash benchmarks/torchrec_env.sh)")
def test_torchrec_peer_trains_the_plain_torch_parameters(tmp_path):
    spec = tiny_spec(tmp_path, system="torchrec")
    result = check_torchrec_peer_trains_what_plain_torch_trains(tmp_path, spec)
    assert result["examples"] == spec.rows and result["peak_rss_bytes"] > 0


@pytest.mark.skipif(not TORCHREC_PYTHON.exists(), reason="no TorchRec environment (bash benchmarks/torchrec_env.sh)")
def test_torchrecs_own_dlrm_trains_what_plain_torch_trains_with_hpsrays_dlrm(tmp_path):
    spec = tiny_spec(tmp_path, system="torchrec", model={"kind": "dlrm", "bottom": [8], "top": [8]})
    check_torchrec_peer_trains_what_plain_torch_trains(tmp_path, spec)
