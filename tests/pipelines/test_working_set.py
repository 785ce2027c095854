"""The trainer keeps its working set across batches (docs/architecture.md: The trainer's
working set): owners ship only the rows it does not hold, it returns only the rows that leave,
a flush stores what it kept, and none of it changes the result."""

import numpy as np
import pytest
import ray

from hpsray.actors.messages import ReadBatch, TrainInputs
from hpsray.actors.trainer import Trainer
from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.errors import WorkingSetError
from hpsray.pipelines import SyntheticSource
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Loan
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS

from small_pipeline import small_pipeline  # tests/small_pipeline.py

GEN = PlantedCTR(n_slots=3, keys_per_slot=2000, n_dense=2, seed=5)
SOURCE = SyntheticSource(GEN, rows=3000)
BATCH = 500
CFG = TrainConfig(dim=4, hidden=(8,), minibatch_size=100, sparse_optimizer="adagrad", sparse_lr=0.05)


def key_sets(source=SOURCE) -> list[np.ndarray]:
    return [np.unique(b.keys) for b in source.open(BATCH)]


def reference(batches: int | None = None, source=SOURCE) -> tuple:
    ref = ReferenceTrainer(source.n_slots, source.n_dense, CFG)
    ref.fit(b for i, b in enumerate(source.open(BATCH)) if batches is None or i < batches)
    return ref.export()


@pytest.mark.parametrize("index_stage", ["train", "read"])  # who makes the batch's index: the same result
def test_rows_shipped_are_the_new_ones_rows_returned_the_leaving_ones_and_the_result_is_the_references(
    ray_local, tmp_path, index_stage
):
    sets = key_sets()
    # the data makes rows leave the working set and come back later
    left_then_back = np.setdiff1d(np.intersect1d(sets[0], sets[2]), sets[1])
    assert left_then_back.size > 0
    with small_pipeline(
        SOURCE,
        CFG,
        mem_rows=1400,  # below the 2222 distinct keys: rows also go to SSD-PS and back
        batch_size=BATCH,
        ssd_dir=tmp_path / "ssd",
        ssd_options=dict(rows_per_file=128),
        trainer=dict(index_stage=index_stage),
    ) as p:
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        made = ray.get(p.actors()["Reader[node 0]"].__ray_call__.remote(lambda r: r.minibatch_size))
    assert (made == CFG.minibatch_size) == (index_stage == "read")
    assert report["ssd"]["bytes_read"] > 0
    moved = report["working_set"]["per_batch"]
    for t, k in enumerate(sets):
        before = sets[t - 1] if t else np.empty(0, np.uint64)
        after = sets[t + 1] if t + 1 < len(sets) else np.empty(0, np.uint64)
        assert moved[str(t)] == {
            "to_trainer": np.setdiff1d(k, before).size,
            "held": np.intersect1d(k, before).size,
            "to_owner": np.setdiff1d(k, after).size,
        }, t
    held = sum(v["held"] for v in moved.values())
    shipped = sum(v["to_trainer"] for v in moved.values())
    assert report["working_set"]["trainer_hit_rate"] == pytest.approx(held / (held + shipped))
    assert 0 < report["working_set"]["bytes_to_owner_per_batch"] < sum(s.size for s in sets) / len(sets) * 4 * 12
    ref_keys, ref_rows, _ = reference()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)


def test_a_flush_stores_the_kept_rows_and_training_goes_on_exactly(ray_local, tmp_path):
    """The schedule's order on one node, in one process: lend t+1 before taking t back. After
    batch 1 the trainer holds rows batch 2 needs and has not returned them; its flush makes the
    owner's rows those of the reference after two batches, and batch 2 then trains on."""
    batches = list(SOURCE.open(BATCH))[:3]
    ssd = SSDPS(str(tmp_path / "ssd"), CFG.row_width, rows_per_file=128)
    lender = Lender(MemPS(1400, CFG.row_width, ssd, CFG.row_init()), 0, CFG.row_init())
    trainer = Trainer(0, 1, CFG, GEN.n_slots, GEN.n_dense, capacity=4000)
    reads = [ReadBatch(len(b), ray.put(b), [ray.put(np.unique(b.keys))]) for b in batches]
    reads.append(ReadBatch(0, ray.put(None), [ray.put(np.empty(0, np.uint64))]))

    def lend(t: int) -> Loan:
        pulled = lender.pull(t, np.unique(batches[t].keys), 0, skip_held=True)
        rows, _ = pulled.load_missing(ssd.load)
        return Loan(rows, pulled.held)

    def train(t: int, loan: Loan):
        r = reads[t]
        inputs = TrainInputs(r.batch, r.keys_by_owner, [ray.put(loan)], [], [r.examples], ray.put(reads[t + 1]))
        trainer.train(t, inputs)
        return trainer.returned(t)

    loan = lend(0)
    for t in range(2):
        returned = train(t, loan)
        loan = lend(t + 1)
        lender.write_back(t, [returned])
    kept = trainer.flush()
    assert kept[0].keys.size == np.intersect1d(np.unique(batches[1].keys), np.unique(batches[2].keys)).size
    assert lender.store_kept(kept) == kept[0].keys.size
    ref_keys, ref_rows, _ = reference(2)
    np.testing.assert_allclose(lender.lookup(ref_keys), ref_rows, rtol=1e-5, atol=1e-5)
    assert trainer.flush() == []  # stored: nothing kept since
    lender.write_back(2, [train(2, loan)])  # the pass's last batch returns every row
    ref_keys, ref_rows, _ = reference(3)
    np.testing.assert_allclose(lender.lookup(ref_keys), ref_rows, rtol=1e-5, atol=1e-5)


def test_an_owner_ships_only_rows_the_borrower_did_not_hold_and_never_loads_them(tmp_path):
    ssd = SSDPS(str(tmp_path / "ssd"), CFG.row_width, rows_per_file=64)
    lender = Lender(MemPS(100, CFG.row_width, ssd, CFG.row_init()), 0, CFG.row_init())
    first, second = np.arange(1, 41, dtype=np.uint64), np.arange(21, 61, dtype=np.uint64)
    lender.pull(0, first, 0, skip_held=True)
    pulled = lender.pull(1, second, 0, skip_held=True)
    assert pulled.held is not None
    np.testing.assert_array_equal(second[pulled.held], np.arange(21, 41, dtype=np.uint64))
    assert pulled.rows.shape[0] == 20  # only keys 41..60 travel
    np.testing.assert_array_equal(pulled.missing_keys, np.arange(41, 61, dtype=np.uint64))
    other = lender.pull(1, second, 1, skip_held=True)  # another borrower held nothing
    assert other.held is None and other.rows.shape[0] == 40


def test_a_trainer_missing_rows_it_was_counted_on_holding_says_so():
    hbm = HbmPS(100, CFG.row_width, CFG.row_init())
    keys = np.arange(1, 11, dtype=np.uint64)
    rows = np.ones((10, CFG.row_width), np.float32)
    hbm.borrow(keys, rows)
    held = np.zeros(12, bool)
    held[:10] = True
    assert hbm.borrow(np.arange(1, 13, dtype=np.uint64), rows[:2], held=held) == 10
    held = np.ones(13, bool)  # key 13 was never borrowed
    with pytest.raises(WorkingSetError, match="lacks 1 of the 13 rows"):
        hbm.borrow(np.arange(1, 14, dtype=np.uint64), rows[:0], held=held)


def test_an_owner_names_the_rows_it_needs_back_from_each_borrower(tmp_path):
    """Keys a borrower may keep into the next batch unless another borrower is lent them anew
    there: that one's refresh reads the owner's copy, so it must be current."""
    ssd = SSDPS(str(tmp_path / "ssd"), CFG.row_width, rows_per_file=64)
    lender = Lender(MemPS(100, CFG.row_width, ssd, CFG.row_init()), 0, CFG.row_init())
    k = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    lender.pull(0, k(1, 2, 3), 0)
    lender.pull(0, k(3, 4), 1)
    lender.pull(1, k(1, 2, 3), 0)
    assert [m.tolist() for m in lender.must_return(1, 2)] == [[1, 2, 3], [3, 4]]  # lease (1, 1) not lent yet
    lender.pull(1, k(2, 3, 5), 1)  # 2 and 5 are new to borrower 1; 3 it held
    back = lender.must_return(1, 2)
    assert back[0].tolist() == [2]  # borrower 0 keeps 1 and 3; 2 goes back for borrower 1's refresh
    assert back[1].tolist() == []  # borrower 0 is lent nothing anew that borrower 1 held
