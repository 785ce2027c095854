"""Cases for the CUDA hash table, run in a subprocess by ``test_cuda_table.py``.

Not collected by pytest (no ``test_`` prefix): numba's CUDA simulator must be switched on
(``NUMBA_ENABLE_CUDASIM=1``) before ``numba.cuda`` is first imported, which must not happen in
the process running the CPU tests. Each case runs the same operations on a ``CudaHashTable``
and a ``CpuHashTable`` and requires equal results: bit for bit under the simulator; on a real
GPU, optimizer updates may differ in the last bits, since NVVM contracts ``a*b+c`` into FMAs.

    python tests/kernels/cudasim_cases.py RESULTS.json [CASE ...]

writes ``{"simulator": bool, "cuda": bool, "results": {case: "ok" | traceback}}``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings

import numpy as np

CASES: dict = {}
TPB = 32  # small blocks: several blocks per launch even with a few hundred keys


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def u64(xs):
    return np.asarray(xs, dtype=np.uint64)


def _mods():
    from numba import config

    from hpsray import kernels
    from hpsray.kernels import cuda as kcuda

    return kernels, kcuda, bool(config.ENABLE_CUDASIM)


def pair(capacity, width, init=None):
    kernels, kcuda, _ = _mods()
    cuda_table = kcuda.CudaHashTable(capacity, width, init, threads_per_block=TPB)
    return cuda_table, kernels.CpuHashTable(capacity, width, init)


def eq(a, b, what=""):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


def eq_opt(a, b, what=""):
    """Equal under the simulator; within float32 rounding (FMA contraction) on a GPU."""
    if _mods()[2]:
        eq(a, b, what)
    else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7, err_msg=what)


def same_table(c, p, what=""):
    assert c.size == p.size, (what, c.size, p.size)
    kc, rc = c.export()
    kp, rp = p.export()
    eq(kc, kp, f"{what}: export keys")
    eq(rc, rp, f"{what}: export rows")
    eq(c.keys(), kp, f"{what}: keys")


def raises(exc, fn, *args):
    try:
        fn(*args)
    except exc as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


# ---------------------------------------------------------------------------------------------


@case
def find_or_insert_with_duplicates():
    from hpsray.kernels import RowInit

    rng = np.random.default_rng(1)
    c, p = pair(400, 6, RowInit(dim=4, scale=0.1, seed=3, state_value=0.5))
    keys = rng.integers(0, 120, 300).astype(np.uint64)
    sc, sp = c.find_or_insert(keys), p.find_or_insert(keys)
    assert isinstance(sc, np.ndarray) and sc.dtype == np.int64
    eq(sc, sp, "slots")
    assert c.size == p.size == np.unique(keys).size
    eq(c.gather(sc), p.gather(sp), "initial rows")
    more = np.concatenate([keys[:50], rng.integers(10_000, 10_100, 150).astype(np.uint64)])
    eq(c.find_or_insert(more), p.find_or_insert(more), "second call, half present")
    probe = np.concatenate([more, u64([5_000_000, 7, 2**63 + 5])])
    eq(c.find(probe), p.find(probe), "find, some absent")
    eq(c.find(u64([])), p.find(u64([])), "empty find")
    eq(c.find_or_insert(u64([])), p.find_or_insert(u64([])), "empty insert")
    same_table(c, p)


@case
def many_keys_multi_level_scans():
    rng = np.random.default_rng(2)
    c, p = pair(800, 2)
    keys = rng.choice(2**40, 700, replace=False).astype(np.uint64)
    keys = np.concatenate([keys, keys[::7]])  # duplicates far apart
    eq(c.find_or_insert(keys), p.find_or_insert(keys), "slots")
    v = rng.standard_normal((keys.size, 2)).astype(np.float32)
    c.scatter_add(keys, v)
    p.scatter_add(keys, v)
    same_table(c, p)


@case
def scan_and_grouping_primitives():
    """The device scan against numpy, and duplicate grouping against a stable argsort."""
    from numba import cuda

    c, _ = pair(4000, 1)
    rng = np.random.default_rng(3)
    for n in (1, 31, 32, 33, 1025, 40_000):
        x = rng.integers(0, 3, n).astype(np.int64)
        out = cuda.device_array(n, np.int64)
        tot = cuda.to_device(np.zeros(4, np.int64))
        c._scan(cuda.to_device(x), out, tot, 2)
        eq(out.copy_to_host(), np.cumsum(x) - x, f"scan n={n}")
        assert tot.copy_to_host()[2] == x.sum()
    for n, hi in ((5, 3), (300, 40), (700, 4000), (64, 1)):
        slots = rng.integers(0, hi, n).astype(np.int64)
        got = c._group(cuda.to_device(slots), n, "t", None, None)
        if np.unique(slots).size == n:
            assert got is None
            continue
        order, starts = (a.copy_to_host() for a in got)
        _, first = np.unique(slots, return_index=True)
        rank = np.empty(slots.max() + 1, np.int64)
        rank[slots[np.sort(first)]] = np.arange(first.size)
        eq(order, np.argsort(rank[slots], kind="stable"), f"order n={n}")
        eq(np.diff(starts), np.bincount(rank[slots]), f"segments n={n}")
        eq(c._first.copy_to_host(), np.iinfo(np.int64).max, "scratch reset")


@case
def gather_rows():
    rng = np.random.default_rng(4)
    c, p = pair(100, 5)
    keys = rng.choice(1000, 80, replace=False).astype(np.uint64)
    vals = rng.standard_normal((80, 5)).astype(np.float32)
    c.insert_or_assign(keys, vals)
    p.insert_or_assign(keys, vals)
    slots = c.find(keys[::-1])
    eq(c.gather(slots), vals[::-1], "gather")
    eq(c.gather(np.r_[slots, slots]), p.gather(np.r_[slots, slots]), "gather with repeats")
    eq(c.get(keys[:10]), vals[:10], "get")
    for t in (c, p):  # only the leading floats of each row (the weights, not the optimizer state)
        eq(t.gather(slots, 2), vals[::-1, :2], "gather of 2 columns")
        eq(t.get(keys[:10], 3), vals[:10, :3], "get of 3 columns")
        raises(ValueError, t.gather, slots, 6)
        raises(ValueError, t.gather, slots, 0)
    assert c.gather(np.empty(0, np.int64)).shape == (0, 5)
    e = raises(KeyError, c.gather, np.array([0, -1]))
    assert "slot -1" in str(e)
    raises(KeyError, c.gather, np.array([100]))
    raises(KeyError, c.get, u64([12345]))


@case
def scatter_add_sums_duplicates():
    rng = np.random.default_rng(5)
    c, p = pair(200, 4)
    keys = rng.integers(0, 60, 250).astype(np.uint64)
    c.find_or_insert(keys)
    p.find_or_insert(keys)
    for rep in range(2):
        q = rng.permutation(keys)
        v = (rng.standard_normal((q.size, 4)) * 10 ** rng.uniform(-3, 3, (q.size, 1))).astype(np.float32)
        c.scatter_add(q, v)
        p.scatter_add(q, v)
        same_table(c, p, f"round {rep}")
    distinct = rng.choice(10_000, 40, replace=False).astype(np.uint64)
    c.find_or_insert(distinct)
    p.find_or_insert(distinct)
    v = rng.standard_normal((40, 4)).astype(np.float32)
    c.scatter_add(distinct, v)  # no duplicates: the direct path
    p.scatter_add(distinct, v)
    same_table(c, p, "distinct")
    before = c.export()
    e = raises(KeyError, c.scatter_add, np.r_[keys[:3], u64([999_999])], np.ones((4, 4), np.float32))
    assert "999999" in str(e)
    eq(c.export()[1], before[1], "unchanged after KeyError")
    raises(ValueError, c.scatter_add, keys[:3], np.ones((3, 5), np.float32))


@case
def assign_last_duplicate_wins():
    rng = np.random.default_rng(6)
    c, p = pair(200, 3)
    keys = rng.integers(0, 80, 200).astype(np.uint64)
    v = rng.standard_normal((200, 3)).astype(np.float32)
    c.insert_or_assign(keys, v)  # inserts too
    p.insert_or_assign(keys, v)
    same_table(c, p)
    last = {}
    for k, row in zip(keys.tolist(), v):
        last[k] = row
    eq(c.get(u64(list(last))), np.stack(list(last.values())), "last wins")
    keys2 = np.r_[keys[:30], rng.integers(500, 520, 30).astype(np.uint64)]
    v2 = rng.standard_normal((60, 3)).astype(np.float32)
    c.insert_or_assign(keys2, v2)
    p.insert_or_assign(keys2, v2)
    same_table(c, p, "second assign")


@case
def assign_present_keys_and_put_by_slot():
    rng = np.random.default_rng(26)
    c, p = pair(200, 3)
    keys = rng.integers(0, 80, 120).astype(np.uint64)
    c.find_or_insert(keys)
    p.find_or_insert(keys)
    v = rng.standard_normal((120, 3)).astype(np.float32)
    c.assign(keys, v)  # present keys only, last duplicate wins
    p.assign(keys, v)
    same_table(c, p, "assign")
    absent = np.r_[keys[:5], u64([1000])]
    raises(KeyError, c.assign, absent, v[:6])
    raises(KeyError, p.assign, absent, v[:6])
    same_table(c, p, "assign of an absent key writes nothing")
    slots_c, slots_p = c.find(keys[:40]), p.find(keys[:40])
    c.put(slots_c, v[40:80])
    p.put(slots_p, v[40:80])
    same_table(c, p, "put")
    raises(KeyError, c.put, np.array([0, -1], np.int64), v[:2])
    fresh = u64([5000, 5001, 5002])
    s_c, s_p = c.find_or_insert(fresh, initialise=False), p.find_or_insert(fresh, initialise=False)
    c.put(s_c, v[:3])
    p.put(s_p, v[:3])
    same_table(c, p, "find_or_insert without initial rows, then put")


@case
def erase_and_reinsert():
    rng = np.random.default_rng(7)
    c, p = pair(64, 2)  # small table, long probe chains
    universe = rng.choice(2**62, 200, replace=False).astype(np.uint64)
    live = universe[:60]
    eq(c.find_or_insert(live), p.find_or_insert(live))
    for rnd in range(6):
        gone = np.r_[rng.choice(live, 25), rng.choice(universe, 5)]  # duplicates and absent keys
        assert c.erase(gone) == p.erase(gone)
        same_table(c, p, f"after erase {rnd}")
        eq(c.find(universe), p.find(universe), f"find after erase {rnd}")
        present = p.find(universe) >= 0
        absent = universe[~present]
        fresh = rng.choice(absent, min(c.capacity - c.size, absent.size), replace=False)
        add = rng.permutation(np.r_[fresh, fresh[:5], universe[present][:10]])
        eq(c.find_or_insert(add), p.find_or_insert(add), f"reinsert {rnd}")
        same_table(c, p, f"after reinsert {rnd}")
        live = universe[np.flatnonzero(p.find(universe) >= 0)]
    assert c.erase(u64([])) == 0
    assert c.erase(live) == p.erase(live) == live.size and c.size == 0
    same_table(c, p, "emptied")
    eq(c.find_or_insert(universe[:64]), p.find_or_insert(universe[:64]), "refill")


@case
def export_ordered_by_slot():
    c, p = pair(50, 3)
    k, r = c.export()
    assert k.dtype == np.uint64 and k.size == 0 and r.shape == (0, 3)
    keys = u64([90, 10, 50, 30, 70])
    c.find_or_insert(keys)
    p.find_or_insert(keys)
    c.erase(u64([10, 30]))
    p.erase(u64([10, 30]))
    c.find_or_insert(u64([11]))
    p.find_or_insert(u64([11]))
    k, r = c.export()
    eq(k, p.export()[0])
    eq(c.find(k), np.sort(c.find(k)), "ordered by slot")


def _optimizer_case(opt, dim, seed):
    from hpsray.kernels import RowInit

    rng = np.random.default_rng(seed)
    init = RowInit.for_optimizer(dim, opt, scale=0.1, seed=seed)
    c, p = pair(150, dim + opt.state_width(dim), init)
    pool = rng.choice(2**50, 100, replace=False).astype(np.uint64)
    c.find_or_insert(pool)
    p.find_or_insert(pool)
    for step in (1, 2):
        keys = rng.choice(pool, 150)  # many duplicates
        g = rng.standard_normal((keys.size, dim)).astype(np.float32)
        c.apply_gradients(keys, g, opt, step)
        p.apply_gradients(keys, g, opt, step)
        kc, rc = c.export()
        kp, rp = p.export()
        eq(kc, kp)
        eq_opt(rc, rp, f"{type(opt).__name__} step {step}")
    keys = pool[:30]  # distinct: the direct path
    g = rng.standard_normal((30, dim)).astype(np.float32)
    c.apply_gradients(keys, g, opt, 3)
    p.apply_gradients(keys, g, opt, 3)
    eq_opt(c.export()[1], p.export()[1], "distinct keys")
    raises(KeyError, c.apply_gradients, u64([12345]), np.ones((1, dim), np.float32), opt, 5)
    raises(ValueError, c.apply_gradients, pool[:2], np.ones((2, dim + 1), np.float32), opt, 5)


@case
def apply_gradients_sgd():
    from hpsray.kernels import SGD

    _optimizer_case(SGD(lr=0.1), 4, 10)


@case
def apply_gradients_adagrad():
    from hpsray.kernels import Adagrad

    _optimizer_case(Adagrad(lr=0.05, initial_accumulator=0.1), 4, 11)


@case
def apply_gradients_adagrad_per_row():
    from hpsray.kernels import Adagrad

    _optimizer_case(Adagrad(lr=0.05, per_row=True), 5, 12)


@case
def apply_gradients_adam():
    from hpsray.kernels import Adam

    _optimizer_case(Adam(lr=0.01), 3, 13)


@case
def apply_gradients_rejects_wrong_width():
    from hpsray.kernels import Adam, RowInit

    c, _ = pair(10, 4, RowInit(dim=4))
    raises(ValueError, c.apply_gradients, u64([1]), np.ones((1, 4), np.float32), Adam(), 1)


@case
def full_table_raises_and_changes_nothing():
    from hpsray.errors import TableFullError

    rng = np.random.default_rng(14)
    c, p = pair(50, 2)
    base = rng.choice(10_000, 40, replace=False).astype(np.uint64)
    c.find_or_insert(base)
    p.find_or_insert(base)
    snapshot = c.export()
    slots = c.find(base)
    new = np.r_[rng.choice(np.arange(20_000, 20_011), 30), base[:5]].astype(np.uint64)  # 11 new > 10 free
    if np.unique(new[new >= 20_000]).size <= 10:
        new = np.r_[new, u64(np.arange(30_000, 30_011))]
    e = raises(TableFullError, c.find_or_insert, new)
    raises(TableFullError, p.find_or_insert, new)
    assert "nothing was inserted" in str(e)
    assert c.size == 40
    eq(c.export()[0], snapshot[0])
    eq(c.export()[1], snapshot[1])
    eq(c.find(base), slots)
    eq(c.find(new[new >= 20_000]), -1)
    raises(TableFullError, c.insert_or_assign, new, np.ones((new.size, 2), np.float32))
    eq(c.export()[1], snapshot[1], "insert_or_assign left the table unchanged")
    # more distinct keys than buckets: the probe bound, not the count, detects it
    huge = rng.choice(2**40, 600, replace=False).astype(np.uint64)
    raises(TableFullError, c.find_or_insert, huge)
    eq(c.export()[0], snapshot[0], "after bucket overflow")
    eq(c.find(base), slots)
    # exactly filling the table works, with the slots the CPU backend gives
    fill = np.arange(50_000, 50_010, dtype=np.uint64)
    cs = c.find_or_insert(np.r_[fill, fill])
    p2 = pair(50, 2)[1]
    p2.find_or_insert(base)
    eq(cs, p2.find_or_insert(np.r_[fill, fill]))
    assert c.size == 50
    raises(TableFullError, c.find_or_insert, u64([1]))


@case
def reserved_and_invalid_keys():
    from numba import cuda

    c, _ = pair(20, 2)
    c.find_or_insert(u64([1, 2, 3]))
    reserved = np.uint64(2**64 - 1)
    raises(ValueError, c.find_or_insert, u64([4, reserved]))
    raises(ValueError, c.find, u64([reserved]))
    raises(TypeError, c.find, np.array([1.5]))
    raises(ValueError, c.find, np.array([-3]))
    raises(ValueError, c.find, np.ones((2, 2), np.uint64))
    # device keys are checked on the device: absent for find, ValueError (table unchanged) on insert
    d = cuda.to_device(u64([4, 1, reserved]))
    eq(c.find(d).copy_to_host(), [-1, 0, -1])
    raises(ValueError, c.find_or_insert, d)
    assert c.size == 3 and c.find(u64([4]))[0] == -1
    assert c.erase(cuda.to_device(u64([reserved]))) == 0
    raises(TypeError, c.find, cuda.to_device(np.array([1.0, 2.0])))


@case
def device_array_inputs():
    from numba import cuda

    from hpsray.kernels import SGD, RowInit
    from hpsray.kernels.cuda import is_device_array

    rng = np.random.default_rng(15)
    init = RowInit(dim=3, scale=0.1, seed=2)
    c, p = pair(120, 3, init)
    keys = rng.integers(0, 70, 150).astype(np.uint64)
    dk = cuda.to_device(keys)
    ds = c.find_or_insert(dk)
    assert is_device_array(ds) and not isinstance(ds, np.ndarray)
    eq(ds.copy_to_host(), p.find_or_insert(keys), "find_or_insert")
    eq(c.find(cuda.to_device(keys.astype(np.int64))).copy_to_host(), p.find(keys), "int64 device keys")
    rows = c.gather(ds)
    assert is_device_array(rows)
    eq(rows.copy_to_host(), p.gather(p.find(keys)), "gather")
    v = rng.standard_normal((150, 3)).astype(np.float32)
    c.scatter_add(dk, cuda.to_device(v))
    p.scatter_add(keys, v)
    same_table(c, p, "scatter_add")
    c.insert_or_assign(dk[:40], cuda.to_device(v[:40]))
    p.insert_or_assign(keys[:40], v[:40])
    same_table(c, p, "assign")
    c.scatter_add(keys, cuda.to_device(v))  # mixed host keys, device values
    p.scatter_add(keys, v)
    same_table(c, p, "mixed")
    c.apply_gradients(dk, cuda.to_device(v), SGD(lr=0.5), 1)
    p.apply_gradients(keys, v, SGD(lr=0.5), 1)
    kc, rc = c.export()
    eq_opt(rc, p.export()[1], "apply_gradients")
    assert is_device_array(c.get(dk))
    raises(KeyError, c.gather, cuda.to_device(np.array([0, -1], np.int64)))
    raises(TypeError, c.scatter_add, dk, cuda.to_device(v.astype(np.float64)))
    raises(ValueError, c.scatter_add, dk, cuda.to_device(v[:, :2].copy()))
    assert c.erase(dk[:10]) == p.erase(keys[:10])
    same_table(c, p, "erase")
    if not _mods()[2]:  # a real GPU: torch CUDA tensors through __cuda_array_interface__
        try:
            import torch
        except ImportError:
            return
        if torch.cuda.is_available():
            tk = torch.as_tensor(keys.astype(np.int64), device="cuda")
            eq(np.asarray(c.find(tk).copy_to_host()), p.find(keys), "torch keys")
            live = p.find(keys) >= 0  # scatter_add needs present keys: the erased ones are gone
            tv = torch.as_tensor(v[live], device="cuda")
            c.scatter_add(tk[torch.as_tensor(live, device="cuda")], tv)
            p.scatter_add(keys[live], v[live])
            same_table(c, p, "torch values")


@case
def random_operation_sequence():
    from hpsray.errors import TableFullError
    from hpsray.kernels import Adagrad, RowInit

    rng = np.random.default_rng(16)
    opt = Adagrad(lr=0.1)
    init = RowInit.for_optimizer(2, opt, scale=0.3, seed=5)
    c, p = pair(30, 4, init)
    universe = rng.choice(2**62, 90, replace=False).astype(np.uint64) * np.uint64(3)  # keys above 2**63 too
    seen = set()
    for step in range(1, 23):
        op = str(rng.choice(["insert", "assign", "scatter", "apply", "erase"], p=[0.3, 0.2, 0.2, 0.2, 0.1]))
        seen.add(op)
        keys = rng.choice(universe, int(rng.integers(1, 40)))
        present = keys[p.find(keys) >= 0]
        try:
            if op == "insert":
                rc = p.find_or_insert(keys)
                eq(c.find_or_insert(keys), rc, op)
            elif op == "assign":
                v = np.abs(rng.standard_normal((keys.size, 4))).astype(np.float32)  # state stays >= 0
                p.insert_or_assign(keys, v)
                c.insert_or_assign(keys, v)
            elif op == "scatter" and present.size:
                v = np.abs(rng.standard_normal((present.size, 4))).astype(np.float32)
                p.scatter_add(present, v)
                c.scatter_add(present, v)
            elif op == "apply" and present.size:
                g = rng.standard_normal((present.size, 2)).astype(np.float32)
                p.apply_gradients(present, g, opt, step)
                c.apply_gradients(present, g, opt, step)
            elif op == "erase":
                assert c.erase(keys) == p.erase(keys)
        except TableFullError:
            seen.add("full")
            raises(TableFullError, c.find_or_insert, keys)
            # the CPU backend restacks the free slots on rollback; rebuild both alike
            kp, rp = p.export()
            c, p = pair(30, 4, init)
            c.insert_or_assign(kp, rp)
            p.insert_or_assign(kp, rp)
        kc, rc_ = c.export()
        kp, rp = p.export()
        eq(kc, kp, f"step {step} {op}")
        eq_opt(rc_, rp, f"step {step} {op}")
    assert seen == {"insert", "assign", "scatter", "apply", "erase", "full"}, seen


@case
def factory():
    from hpsray.kernels import make_table
    from hpsray.kernels.cuda import CudaHashTable, cuda_available

    assert cuda_available()
    t = make_table(10, 2, device="cuda", threads_per_block=32)
    assert isinstance(t, CudaHashTable) and t.threads_per_block == 32
    raises(ValueError, lambda: make_table(10, 2, device="cuda", threads_per_block=2048))


@case
def fused_lookup_pool_backward_apply():
    """The fused sparse path (hpsray.kernels.cuda.fused) against the CPU kernels: bags with
    repeated keys, empty bags and keys out of slot order; pooled sums, per-row gradients and
    the optimizer at the slots found, bit for bit under the simulator."""
    from hpsray.kernels import Adagrad, RowInit
    from hpsray.kernels.arrays import distinct_inverse
    from hpsray.kernels.fused import bag_ends, pool_backward

    rng = np.random.default_rng(7)
    n_examples, n_slots, dim = 9, 3, 4
    per = rng.integers(0, 4, size=(n_examples, n_slots))  # zeros: empty bags
    slots = [rng.permutation(np.repeat(np.arange(n_slots, dtype=np.int32), per[e])) for e in range(n_examples)]
    offsets = np.cumsum([0] + [s.size for s in slots]).astype(np.int64)
    slot_ids = np.concatenate(slots)
    keys = rng.integers(1, 6, slot_ids.size).astype(np.uint64) * np.uint64(1000) + slot_ids.astype(np.uint64)
    ends, order = bag_ends(offsets, slot_ids, n_slots)
    unique_keys, inverse = distinct_inverse(np, keys if order is None else keys[order])
    c, p = pair(64, 2 * dim, RowInit(dim=dim, scale=0.5, seed=1))
    extra = u64([77_001, 77_002])
    for t in (c, p):
        t.find_or_insert(np.concatenate([extra, unique_keys]))
    pooled_c, slots_c = c.lookup_pool(unique_keys, inverse, ends, dim)
    pooled_p, slots_p = p.lookup_pool(unique_keys, inverse, ends, dim)
    eq(slots_c.copy_to_host(), slots_p, "slots")
    eq(pooled_c.copy_to_host(), pooled_p, "pooled")
    grad = rng.standard_normal(pooled_p.shape).astype(np.float32)
    acc_c = c.pool_backward(grad, ends, inverse, unique_keys.size).copy_to_host()
    acc_p = pool_backward(grad, ends, inverse, unique_keys.size)
    eq(acc_c, acc_p, "row gradients")
    opt = Adagrad(lr=0.1)
    c.apply_at_slots(slots_c, acc_c, opt, 1)
    p.apply_at_slots(slots_p, acc_p, opt, 1)
    same_table(c, p, "after the update")
    assert c.holds_at(slots_c, unique_keys) and not c.holds_at(slots_c.copy_to_host()[::-1].copy(), unique_keys)
    raises(KeyError, c.lookup_pool, np.concatenate([unique_keys, u64([999_999])]), inverse, ends, dim)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # uint64 hashing, simulated
    out_path, names = argv[0], argv[1:] or list(CASES)
    from numba import config, cuda

    report = {"simulator": bool(config.ENABLE_CUDASIM), "cuda": bool(cuda.is_available()), "results": {}, "seconds": {}}
    if report["cuda"]:
        for name in names:
            t0 = time.perf_counter()
            try:
                CASES[name]()
                report["results"][name] = "ok"
            except Exception:
                report["results"][name] = traceback.format_exc()
            report["seconds"][name] = round(time.perf_counter() - t0, 2)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
