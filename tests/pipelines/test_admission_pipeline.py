"""Feature admission and expiry on the single-node system (docs/architecture.md: Admission and
expiry): lossless against the reference trainer applying the same rules, over two passes and
with rows travelling to SSD-PS, where expired rows are deleted; the model shrinks by the keys
seen in fewer than ``admit_after`` batches."""

import numpy as np
import ray

from hpsray.data import PlantedCTR
from hpsray.pipelines import SyntheticSource
from hpsray.reference import ReferenceTrainer

from small_pipeline import small_config, small_pipeline  # tests/small_pipeline.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=3000, n_dense=3, seed=1)  # Zipf keys
SOURCE = SyntheticSource(GEN, rows=6000)
SECOND = SyntheticSource(GEN, rows=3000, start_row=6000)
BATCH = 1000
CFG = small_config(hidden=(16,), minibatch_size=200, sparse_optimizer="adagrad", sparse_lr=0.05)
RULES = dict(admit_after=2, expire_after_batches=3)


def batches_seen(source) -> tuple[np.ndarray, np.ndarray]:
    """Each key of ``source`` and the number of batches it appears in."""
    return np.unique(np.concatenate([np.unique(b.keys) for b in source.open(BATCH)]), return_counts=True)


def test_admission_alone_drops_exactly_the_keys_seen_in_one_batch():
    plain = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG)
    plain.fit(SOURCE.open(BATCH))
    admitted = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG, admit_after=2)
    admitted.fit(SOURCE.open(BATCH))
    keys, seen = batches_seen(SOURCE)
    once = keys[seen < 2]
    assert once.size > 0.3 * keys.size  # the Zipf tail: most distinct keys show up once
    got = admitted.export()[0]
    assert len(plain.store) - got.size == once.size
    np.testing.assert_array_equal(got, keys[seen >= 2])
    st = admitted.admission.stats
    assert st["admitted"] == got.size and st["rejected"] == keys.size  # every key's first batch


def test_pipeline_with_admission_and_expiry_is_lossless_over_two_passes(ray_local, tmp_path):
    with small_pipeline(
        SOURCE,
        CFG,
        mem_rows=1500,  # below the working set: rows go to SSD-PS and back
        batch_size=BATCH,
        ssd_dir=tmp_path / "ssd",
        ssd_options=dict(rows_per_file=256),
        trainer=dict(n_devices=2),
        mem=RULES,
        preflight=False,  # the plan's bound for two devices is above this budget; the rows the run pins fit
    ) as p:
        first = p.fit(progress=False)
        p.source = SECOND
        second = p.fit(progress=False)
        keys, rows = p.export_rows()  # MEM-PS flushed, SSD-PS scanned: what SSD-PS holds
        dense = p.dense_state()
        store = ray.get(p.actors()["SSDPS[node 0]"].stats.remote())["store"]
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG, **RULES)
    ref.fit(SOURCE.open(BATCH))
    ref_first = dict(ref.admission.stats)
    ref.fit(SECOND.open(BATCH))
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
    # the report counts what the reference counted (its totals run from the first batch on)
    for name in ("admitted", "rejected", "expired"):
        assert first["cache"][name] == ref_first[name] > 0, name
        assert second["cache"][name] == ref.admission.stats[name], name
    assert second["ssd"]["bytes_read"] > 0  # rows evicted in one batch were loaded back in a later one
    # rows had reached SSD-PS before they expired, and were deleted there
    assert store["rows_deleted"] > 0 and store["live_rows"] == ref_keys.size
    plain_keys = np.unique(np.concatenate([np.unique(b.keys) for s in (SOURCE, SECOND) for b in s.open(BATCH)]))
    assert ref_keys.size < 0.6 * plain_keys.size
