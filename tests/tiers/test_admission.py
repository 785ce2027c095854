"""Feature admission and expiry without Ray: the exact counter (hpsray.tiers.admission), the
owner's rules over it (Lender), what MEM-PS and SSD-PS do to drop rows (drop, tombstones), and
the reference trainer's side (docs/architecture.md: Admission and expiry)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.reference import ReferenceTrainer, SortedRowStore
from hpsray.tiers.admission import Admission
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Returned
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS

from loading import lend, pull_loaded  # tests/loading.py
from small_pipeline import small_config  # tests/small_pipeline.py

W = 4
INIT = RowInit(dim=W, scale=0.1, seed=3)


def keys(*values: int) -> np.ndarray:
    return np.array(sorted(values), dtype=np.uint64)


# -- the counter ---------------------------------------------------------------------------


def test_a_key_is_admitted_in_the_batch_it_is_seen_for_the_nth_time_counting_batches():
    adm = Admission(admit_after=3)
    assert adm.see(0, keys(1, 2)).tolist() == [False, False]
    assert adm.see(0, keys(1)).tolist() == [False]  # another borrower in the same batch: no count
    assert adm.see(1, keys(1, 3)).tolist() == [False, False]
    assert adm.see(2, keys(1, 2, 3)).tolist() == [True, False, False]
    assert adm.see(3, keys(1)).tolist() == [True]  # stays admitted
    assert adm.admitted(keys(1, 2, 9)).tolist() == [True, False, False]
    # sightings refused: (0: 1, 2) (1: 1, 3) (2: 2, 3); admitted: key 1 once
    assert adm.stats == {"admitted": 1, "rejected": 6, "expired": 0, "forgotten": 0, "tracked": 3}


@pytest.mark.parametrize("admit_after", [0, 1])
def test_admit_after_zero_or_one_admits_every_key_and_is_off(admit_after):
    adm = Admission(admit_after)
    assert not adm.enabled
    assert adm.see(0, keys(5, 6)).all()
    assert adm.stats["admitted"] == 2 and adm.stats["rejected"] == 0


def test_expiry_forgets_keys_not_seen_for_n_batches_and_they_count_again_from_one():
    adm = Admission(admit_after=2, expire_after_batches=2)
    adm.see(0, keys(1, 2, 3))
    adm.see(1, keys(1, 2))  # 1, 2 admitted; 3 seen once
    assert adm.expire(1).size == 0  # nothing is 2 batches old yet
    adm.see(2, keys(1))
    np.testing.assert_array_equal(adm.expire(2), keys())  # 3 (never admitted) is forgotten silently
    assert adm.stats["forgotten"] == 1
    adm.see(3, keys(1))
    np.testing.assert_array_equal(adm.expire(3), keys(2))  # last seen in 1: a row to drop
    assert adm.expire(3).size == 0  # idempotent
    assert adm.see(4, keys(2, 3)).tolist() == [False, False]  # both start again from one
    assert adm.stats == {"admitted": 2, "rejected": 5, "expired": 1, "forgotten": 1, "tracked": 3}


def test_the_table_grows_and_its_state_round_trips(tmp_path):
    adm = Admission(admit_after=2, expire_after_batches=5, capacity=16)
    many = np.arange(1, 5001, dtype=np.uint64)
    adm.see(0, many)
    adm.see(1, many[::2][::-1].copy())  # unsorted distinct keys are fine
    assert len(adm) == 5000
    assert adm.admitted(many).sum() == 2500
    adm.expire(1)
    adm.save(tmp_path / "adm.npz")
    again = Admission(admit_after=2, expire_after_batches=5)
    again.load(tmp_path / "adm.npz")
    np.testing.assert_array_equal(again.admitted(many), adm.admitted(many))
    assert again.stats == adm.stats
    np.testing.assert_array_equal(again.expire(6), adm.expire(6))
    with pytest.raises(ValueError, match="restored into"):
        Admission(admit_after=3).load(tmp_path / "adm.npz")


@pytest.mark.parametrize("bad", [dict(admit_after=-1), dict(expire_after_batches=0), dict(admit_after=1.5)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Admission(**bad)


# -- SSD-PS delete -------------------------------------------------------------------------


def test_deleted_rows_stay_deleted_across_reopen_and_snapshots_and_compaction_reclaims_them(tmp_path):
    d = tmp_path / "ssd"
    ks = np.arange(1, 41, dtype=np.uint64)
    store = SSDPS(d, W, rows_per_file=8, background=False)
    store.dump(ks, np.ones((40, W), np.float32))
    store.dump(ks[:10], np.full((10, W), 2.0, np.float32))
    assert store.delete(np.concatenate([ks[5:15], keys(999)])) == 10  # 999 was never stored
    assert store.delete(ks[5:15]) == 0  # already gone: no tombstones written
    assert len(store) == 30 and store.stats["tombstone_files"] == 2
    assert not store.contains(ks[5:15]).any()
    snap = store.snapshot(tmp_path / "snap")
    assert snap["rows"] == 30
    store.close()

    store = SSDPS(d, W, rows_per_file=8, background=False)  # reopen: the tombstones win
    rows, found = store.load(ks)
    assert found.sum() == 30 and not found[5:15].any()
    np.testing.assert_array_equal(rows[:5], np.full((5, W), 2.0, np.float32))
    store.compact(full=True)  # every file that may hold an older copy goes: so do the tombstones
    st = store.stats
    assert st["tombstone_files"] == 0 and st["stale_rows"] == 0
    assert st["disk_bytes"] <= 1.5 * st["live_bytes"]
    store.dump(ks[5:7], np.full((2, W), 3.0, np.float32))  # a later dump brings a key back
    store.close()
    store = SSDPS(d, W, rows_per_file=8, background=False)
    rows, found = store.load(ks[4:8])
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(rows[1:3], np.full((2, W), 3.0, np.float32))
    store.close()

    SSDPS.restore(tmp_path / "snap", tmp_path / "restored")
    restored = SSDPS(tmp_path / "restored", W, background=False)
    assert len(restored) == 30 and not restored.contains(ks[5:15]).any()
    restored.close()


def test_a_tombstone_file_is_retired_only_once_older_copies_are_gone(tmp_path):
    store = SSDPS(tmp_path / "ssd", W, rows_per_file=64, background=False)
    first, second = np.arange(1, 65, dtype=np.uint64), np.arange(65, 129, dtype=np.uint64)
    store.dump(first, np.ones((64, W), np.float32))
    store.dump(second, np.ones((64, W), np.float32))
    store.delete(first[:1])  # the first file holds the only copy: the tombstones' dependency
    assert store.stats["tombstone_files"] == 1
    assert store.compact() == 0  # 1 stale row of 64 is under the threshold: nothing to do
    assert store.stats["tombstone_files"] == 1
    store.delete(first[1:40])  # most of the first file is stale now
    assert store.compact() >= 1
    assert store.stats["tombstone_files"] == 0 and store.stats["tombstone_files_retired"] == 2
    store.close()
    store = SSDPS(tmp_path / "ssd", W, rows_per_file=64, background=False)
    assert len(store) == 128 - 40 and not store.contains(first[:40]).any()
    store.close()


# -- MEM-PS drop ---------------------------------------------------------------------------


def test_mem_ps_drops_unpinned_rows_unwritten_and_refuses_pinned_ones(tmp_path):
    store = SSDPS(tmp_path / "ssd", W)
    mem = MemPS(16, W, store, INIT)
    pull_loaded(mem, 0, keys(1, 2, 3))
    mem.write_back(0, keys(1, 2, 3), np.full((3, W), 5.0, np.float32))
    pull_loaded(mem, 1, keys(3))
    with pytest.raises(ValueError, match="pinned"):
        mem.drop(keys(2, 3))
    assert mem.contains(keys(2, 3)).all()
    mem.unpin(0)
    assert mem.drop(keys(1, 2, 9)) == 2
    assert mem.contains(keys(1, 2, 3)).tolist() == [False, False, True]
    assert mem.flush() == 1 and len(store) == 1  # the dropped dirty rows were never written
    assert mem.stats["dropped"] == 2
    store.close()


# -- the owner's rules ---------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = SSDPS(str(tmp_path / "ssd"), W)
    yield s
    s.close()


def test_keys_not_admitted_are_lent_initial_rows_and_their_returns_dropped(store):
    lender = Lender(MemPS(64, W, store, INIT), 0, INIT, Admission(admit_after=2))
    k = keys(1, 2)
    np.testing.assert_array_equal(lend(lender, 0, k), initial_rows(k, W, INIT))
    assert not lender.mem.contains(k).any()  # no row, no pin
    assert lender.write_back(0, [Returned(0, k, np.full((2, W), 9.0, np.float32))]) == 0
    np.testing.assert_array_equal(lender.lookup(k), initial_rows(k, W, INIT))  # looked up as initial
    rows = lend(lender, 1, keys(1, 3))  # 1 admitted now, from its initial row; 3 seen once
    np.testing.assert_array_equal(rows, initial_rows(keys(1, 3), W, INIT))
    assert lender.mem.pinned(keys(1, 3)).tolist() == [True, False]
    assert lender.write_back(1, [Returned(0, keys(1, 3), np.full((2, W), 7.0, np.float32))]) == 1
    np.testing.assert_array_equal(lender.lookup(keys(1, 3))[:, 0], [7.0, initial_row(3)[0]])


def initial_row(key: int) -> np.ndarray:
    return initial_rows(keys(key), W, INIT)[0]


def test_refresh_resets_every_copy_of_a_key_lent_without_a_row_the_batch_before(store):
    lender = Lender(MemPS(64, W, store, INIT), 0, INIT, Admission(admit_after=2))
    lend(lender, 0, keys(1, 2), borrower=0)
    lend(lender, 0, keys(2, 3), borrower=1)
    lend(lender, 1, keys(1, 3), borrower=0)  # lent while batch 0 trains: 1 and 3 are admitted now
    lend(lender, 1, keys(2, 4), borrower=1)
    ones = np.ones((2, W), np.float32)
    lender.write_back(0, [Returned(0, keys(1, 2), ones), Returned(1, keys(2, 3), ones)])
    for borrower, expect in ((0, keys(1, 3)), (1, keys(2))):
        fresh = lender.refresh(1, borrower)
        np.testing.assert_array_equal(fresh.keys, expect)
        np.testing.assert_array_equal(fresh.rows, initial_rows(expect, W, INIT))


def test_expired_rows_leave_mem_ps_and_ssd_ps_and_come_back_as_new_keys(store):
    lender = Lender(MemPS(64, W, store, INIT), 0, INIT, Admission(expire_after_batches=2))
    lend(lender, 0, keys(1, 2))
    lender.write_back(0, [Returned(0, keys(1, 2), np.full((2, W), 3.0, np.float32))])
    lender.mem.flush()
    assert len(store) == 2
    for t in (1, 2):
        lend(lender, t, keys(2))
        lender.write_back(t, [Returned(0, keys(2), np.full((1, W), 4.0, np.float32))])
    # key 1, last seen in batch 0, expired at the end of batch 2: gone from both tiers
    assert not lender.mem.contains(keys(1)).any() and not store.contains(keys(1)).any()
    assert lender.admission.stats["expired"] == 1
    np.testing.assert_array_equal(lend(lender, 3, keys(1)), initial_rows(keys(1), W, INIT))


def test_expiry_needs_a_store_that_deletes(store):
    class NoDelete:
        width = W

        def load(self, k):
            return np.zeros((k.size, W), np.float32), np.zeros(k.size, bool)

        def dump(self, k, r):
            pass

    with pytest.raises(TypeError, match="no delete"):
        Lender(MemPS(8, W, NoDelete(), INIT), 0, INIT, Admission(expire_after_batches=3))


def sequential(batches: list[list[np.ndarray]], admit_after: int, expire: int | None) -> dict[int, np.ndarray]:
    """The rules applied one batch at a time to a dict of rows (+1 per borrower that touched a key)."""
    adm = Admission(admit_after, expire)
    rows: dict[int, np.ndarray] = {}
    for t, parts in enumerate(batches):
        touched, counts = np.unique(np.concatenate(parts), return_counts=True)
        for k in adm.expire(t - 1).tolist():
            rows.pop(k, None)
        admitted = adm.see(t, touched)
        for k, c, a in zip(touched.tolist(), counts, admitted):
            if a:
                rows[k] = rows.get(k, initial_row(k)) + c
        for k in adm.expire(t).tolist():
            rows.pop(k, None)
    return rows


@pytest.mark.parametrize("admit_after,expire", [(2, None), (3, 2), (0, 1), (2, 3)])
def test_a_pipelined_two_borrower_schedule_applies_the_rules_like_a_sequential_run(store, admit_after, expire):
    """Each batch lent before the previous one is taken back, borrowers keeping rows resident
    (HbmPS), refresh after each take-back: the owner ends with the sequential rows, and holds
    rows for exactly the admitted, unexpired keys."""
    rng = np.random.default_rng(admit_after * 10 + (expire or 0))
    universe = np.arange(1, 100, dtype=np.uint64)
    batches = [[np.unique(rng.choice(universe[: 40 + 5 * t], 14)) for _ in range(2)] for t in range(12)]
    lender = Lender(MemPS(64, W, store, INIT), 0, INIT, Admission(admit_after, expire))
    hbms = [HbmPS(128, W, INIT) for _ in range(2)]
    loans = [lend(lender, 0, batches[0][b], borrower=b) for b in range(2)]
    for t, parts in enumerate(batches):
        for b in range(2):
            fresh = lender.refresh(t, b)
            hbms[b].borrow(parts[b], loans[b], [(fresh.keys, fresh.rows)])
        keys_all, counts = np.unique(np.concatenate(parts), return_counts=True)
        for b in range(2):
            add = counts[np.searchsorted(keys_all, parts[b])].astype(np.float32)
            hbms[b].insert_or_assign(parts[b], hbms[b].get(parts[b]) + add[:, None])
        if t + 1 < len(batches):
            loans = [lend(lender, t + 1, batches[t + 1][b], borrower=b) for b in range(2)]
        lender.write_back(t, [Returned(b, parts[b], hbms[b].get(parts[b])) for b in range(2)])
    expected = sequential(batches, admit_after, expire)
    got = lender.lookup(universe)
    want = np.stack([expected.get(int(k), initial_row(int(k))) for k in universe])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    lender.mem.flush()
    held = np.union1d(lender.mem._table.keys(), np.concatenate([k for k, _ in store.scan()] or [keys()]))
    np.testing.assert_array_equal(held, np.array(sorted(expected), dtype=np.uint64))


# -- the reference -------------------------------------------------------------------------


def test_sorted_row_store_drops_rows_and_reclaims_them():
    st = SortedRowStore(W, INIT)
    ks = np.arange(1, 3001, dtype=np.uint64)
    st.positions(ks)
    before = st.peek(ks[2000:])
    assert st.drop(ks[:2000]) == 2000 and st.drop(keys(1)) == 0
    assert len(st) == 1000 and st._n == 1000  # compacted
    np.testing.assert_array_equal(st.peek(ks[2000:]), before)
    np.testing.assert_array_equal(st.export()[0], ks[2000:])


def test_the_reference_keeps_rows_only_of_admitted_unexpired_keys():
    gen = PlantedCTR(n_slots=3, keys_per_slot=400, n_dense=2, seed=5)
    cfg = TrainConfig(dim=W, hidden=(8,), minibatch_size=100)
    batches = list(gen.batches(1500, 300))
    plain = ReferenceTrainer(3, 2, cfg)
    plain.fit(batches)
    ref = ReferenceTrainer(3, 2, cfg, admit_after=2, expire_after_batches=3)
    ref.fit(batches)
    expected = sequential([[np.unique(b.keys)] for b in batches], 2, 3)
    k, _, _ = ref.export()
    np.testing.assert_array_equal(k, np.array(sorted(expected), dtype=np.uint64))
    assert 0 < k.size < len(plain.store)
    assert ref.batches == 5
    with pytest.raises(ValueError):
        ReferenceTrainer(3, 2, cfg, admit_after=-1)


@pytest.mark.parametrize(
    "admit, expire, message",
    [
        (-1, None, "admit_after must be an integer >= 0, got -1"),
        (True, None, "admit_after must be an integer >= 0, got True"),
        (2, 0, "expire_after_batches must be an integer >= 1 or None, got 0"),
        (2, 1.5, "expire_after_batches must be an integer >= 1 or None, got 1.5"),
    ],
)
def test_the_pipeline_and_the_reference_refuse_the_same_admission_settings(admit, expire, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Admission(admit, expire)
    with pytest.raises(ValueError, match=re.escape(message)):
        ReferenceTrainer(2, 1, small_config(), admit_after=admit, expire_after_batches=expire)
