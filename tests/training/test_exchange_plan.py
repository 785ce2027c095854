"""BSP's exchange resolved once per batch applies exactly what the per-call lookup applies: the
same rows, the same bits (``training/exchange_plan.py`` against ``TrainerEngine.apply_updates``)."""

from __future__ import annotations

import numpy as np
import torch
from inprocess import ThreadGroup, run_ranks  # tests/training/inprocess.py
from paths import N_DENSE, N_SLOTS, config  # tests/training/paths.py

from hpsray.kernels.init import initial_rows
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.exchange_plan import ExchangePlan
from hpsray.training.layout import keys_as_tensor


def test_the_exchange_plan_applies_what_apply_updates_applies():
    cfg = config("adam")
    rng = np.random.default_rng(3)
    held = np.unique(rng.integers(1, 400, 150).astype(np.uint64))  # the rows this node holds
    engines = []
    for _ in range(2):
        engine = TrainerEngine(cfg, N_SLOTS, N_DENSE, 1000, n_nodes=2)
        engine.borrow(0, [held], [Loan(initial_rows(held, cfg.row_width, cfg.row_init()))])
        engines.append(engine)
    n_mb = 3
    # per global mini-batch, each rank's distinct keys: this node's among those it holds (and one
    # mini-batch with none), the other node's anywhere (some not held here, some held by both)
    own = [np.sort(rng.choice(held, 40, replace=False)) for _ in range(n_mb - 1)] + [np.empty(0, np.uint64)]
    other = [np.unique(rng.integers(1, 500, 60).astype(np.uint64)) for _ in range(n_mb)]
    group = ThreadGroup(2)
    plans = []

    def rank(r: int) -> None:
        member = group.member(r)
        if r == 0:
            plans.append(
                ExchangePlan.of(engines[0], [keys_as_tensor(k, torch.device("cpu")) for k in own], n_mb, member)
            )
        else:  # the other node's side of the two all-gathers
            counts = np.array([k.size for k in other], np.uint64)
            member.allgather_sparse(counts, np.empty((n_mb, 0), np.float32))
            keys = np.concatenate(other)
            member.allgather_sparse(keys, np.empty((keys.size, 0), np.float32))

    run_ranks(2, rank)
    for k in range(n_mb):
        keys = np.concatenate([own[k], other[k]])
        grads = rng.standard_normal((keys.size, cfg.dim)).astype(np.float32)
        for engine in engines:
            engine.step += 1
        plans[0].apply(k, torch.from_numpy(grads), engines[0].step)
        engines[1].apply_updates(keys, grads)
    np.testing.assert_array_equal(engines[0].rows(held), engines[1].rows(held))
    assert not np.array_equal(engines[0].rows(held), initial_rows(held, cfg.row_width, cfg.row_init()))


def test_a_bsp_minibatch_exchanges_no_sizes():
    """Every all-gather of a BSP batch (the plan's two, each mini-batch's one) is told every
    node's count, which the plan knows: no exchange of sizes and no read-back of them per
    mini-batch (a real group would otherwise gather the sizes first and read them back). The
    in-process group checks each count given against what the ranks sent."""
    from paths import path  # tests/training/paths.py

    go, strategies = path("bsp", "adagrad")  # trains the first batch
    go()
    groups = [s.group for s in strategies]  # type: ignore[attr-defined]
    assert [g.uncounted for g in groups] == [0, 0]
    assert all(g.bytes_sent > 0 for g in groups)


def test_a_device_minibatch_is_routed_without_exchanging_counts():
    """Every device process sees the node's whole part, so where each device's keys go and how
    many come to it are known at the batch's start: each mini-batch's lookup and route are told
    (no all-to-all of counts, nothing read back on a GPU); the in-process mesh checks each
    routing against the keys and counts the calls without one."""
    from paths import path  # tests/training/paths.py

    go, strategies = path("devices", "adam")  # trains the first batch
    go()
    meshes = [s.mesh for s in strategies]  # type: ignore[attr-defined]
    assert [m.unrouted for m in meshes] == [0, 0]
