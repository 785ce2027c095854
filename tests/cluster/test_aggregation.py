"""Dense aggregation: the chunk assignment, the aggregator's rank-ordered sum, and both reducers
on a real two-node Ray cluster (``ray.cluster_utils.Cluster``), plus ``hpsray bench exchange``."""

import asyncio
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from hpsray.cluster.aggregation import (
    DEFAULT_CHUNK_BYTES,
    AllReduceDense,
    ChunkAggregatorActor,
    ChunkedAggregator,
    ChunkPlan,
    DenseReducer,
    assign_chunks,
    chunk_elements,
    n_chunks,
)

# -- the assignment: a pure function --------------------------------------------------------------


@pytest.mark.parametrize("chunks", [0, 1, 2, 3, 7, 47, 64, 1000, 1001])
@pytest.mark.parametrize("aggs", [1, 2, 3, 5, 8, 64])
def test_every_chunk_has_one_aggregator_and_counts_differ_by_at_most_one(chunks, aggs):
    owner = assign_chunks(chunks, aggs)
    assert owner.shape == (chunks,) and owner.dtype == np.int64
    assert np.all((owner >= 0) & (owner < aggs))
    assert np.all(np.diff(owner) >= 0)  # contiguous runs
    counts = np.bincount(owner, minlength=aggs)
    assert counts.sum() == chunks and counts.max() - counts.min() <= 1
    assert np.array_equal(owner, assign_chunks(chunks, aggs))  # fixed


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 384_513, 3 * 8192 + 5])
@pytest.mark.parametrize("aggs", [1, 2, 3, 7])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096, 4])
def test_plan_covers_the_gradient_and_balances_bytes(n, aggs, chunk_bytes):
    plan = ChunkPlan.build(n, aggs, chunk_bytes)
    assert plan.n_chunks == n_chunks(n, chunk_bytes) == -(-n // chunk_elements(chunk_bytes))
    # the bounds tile [0, n) in aggregator order, each a whole number of chunks (but the tail)
    edges = [lo for lo, _ in plan.bounds] + [plan.bounds[-1][1]]
    assert edges[0] == 0 and edges[-1] == n and edges == sorted(edges)
    assert all(hi == plan.bounds[a + 1][0] for a, (_, hi) in enumerate(plan.bounds[:-1]))
    per = chunk_elements(chunk_bytes)
    assert all(lo % per == 0 for lo, hi in plan.bounds if hi > lo)
    loads = plan.byte_loads()
    assert sum(loads) == 4 * n
    assert max(loads) - min(loads) <= chunk_bytes
    assert plan.chunk_counts() == np.bincount(plan.owner, minlength=aggs).tolist()


def test_default_chunk_is_32_kib_and_bad_sizes_are_refused():
    assert chunk_elements() == 8192
    for bad in (0, 3, 6, -4):
        with pytest.raises(ValueError, match="chunk_bytes"):
            chunk_elements(bad)
    with pytest.raises(ValueError):
        assign_chunks(3, 0)
    with pytest.raises(ValueError):
        ChunkedAggregator([object()], world=2, rank=2)


def test_both_reducers_satisfy_the_protocol():
    assert isinstance(AllReduceDense("g"), DenseReducer)
    assert isinstance(ChunkedAggregator([object()], world=1, rank=0), DenseReducer)


def test_messages_split_an_aggregators_run_into_whole_chunks():
    agg = ChunkedAggregator([object(), object()], world=2, rank=0, chunk_bytes=16, message_bytes=40)
    msgs = agg.messages(21)  # 6 chunks of 4 values (last has 1): aggregator 0 gets 3, aggregator 1 gets 3
    assert msgs == [(0, 0, 8), (0, 8, 12), (1, 12, 20), (1, 20, 21)]
    whole = ChunkedAggregator([object(), object()], world=2, rank=0, chunk_bytes=16, message_bytes=None)
    assert whole.messages(21) == [(0, 0, 12), (1, 12, 21)]
    assert whole.messages(17) == [(0, 0, 8), (1, 8, 17)]  # 5 chunks: the short tail's aggregator has 3


# -- the aggregator actor's logic, without Ray -------------------------------------------------------


def rank_ordered_sum(parts):
    total = np.array(parts[0], dtype=np.float32, copy=True)
    for p in parts[1:]:
        total = total + p
    return total


def test_aggregator_sums_in_rank_order_whatever_the_arrival_order():
    rng = np.random.default_rng(0)
    # magnitudes chosen so float32 addition is not associative: the order shows in the bits
    parts = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 4, 1000)).astype(np.float32) for _ in range(4)]
    expected = rank_ordered_sum(parts)
    assert not np.array_equal(expected, rank_ordered_sum(parts[::-1]))

    async def main():
        agg = ChunkAggregatorActor(0, world=4)
        outs = await asyncio.gather(*(agg.push(7, r, parts[r]) for r in (2, 0, 3, 1)))
        return agg, outs

    agg, outs = asyncio.run(main())
    for out in outs:
        assert out.dtype == np.float32 and np.array_equal(out, expected)
    assert agg.stats()["open_steps"] == [] and agg.stats()["steps_reduced"] == 1


def test_aggregator_refuses_duplicates_mismatches_and_times_out():
    async def duplicate():
        agg = ChunkAggregatorActor(0, world=2, timeout_s=0.5)
        first = asyncio.ensure_future(agg.push(0, 0, np.ones(3, np.float32)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="twice"):
            await agg.push(0, 0, np.ones(3, np.float32))
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
            await first

    asyncio.run(duplicate())

    async def mismatch():
        agg = ChunkAggregatorActor(0, world=2)
        return await asyncio.gather(
            agg.push(0, 0, np.ones(3, np.float32)), agg.push(0, 1, np.ones(4, np.float32)), return_exceptions=True
        )

    outs = asyncio.run(mismatch())
    assert all(isinstance(o, ValueError) and "different lengths" in str(o) for o in outs)

    async def bad_rank_and_dtype():
        agg = ChunkAggregatorActor(0, world=2)
        with pytest.raises(ValueError, match="outside world"):
            await agg.push(0, 2, np.ones(3, np.float32))
        with pytest.raises(TypeError, match="float32"):
            await agg.push(0, 0, np.ones(3, np.float64))

    asyncio.run(bad_rank_and_dtype())


# -- the benchmark command (its own simulated cluster, in a subprocess; runs before the fixture) ---


@pytest.mark.slow
def test_bench_exchange_json_emits_both_modes():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpsray",
            "bench",
            "exchange",
            "--json",
            "--steps",
            "5",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--dense-bytes",
            "40004",
            "--chunk-bytes",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["benchmark"] == "exchange" and report["nodes"] == 2 and report["distinct_ray_nodes"] == 2
    for mode in ("allreduce", "chunked"):
        assert report[mode]["steps_per_s"] > 0 and report[mode]["bytes_per_s"] > 0
    assert report["chunked_vs_allreduce"] > 0
    chunked = report["chunked"]
    assert chunked["chunks"] == 10 and chunked["aggregator_chunk_loads"] == [5, 5]
    assert sum(chunked["aggregator_byte_loads"]) == report["dense_bytes"] == 40004
    assert chunked["bit_identical_across_ranks"] and chunked["equals_rank_ordered_sum"]
    assert report["allreduce"]["max_abs_diff_vs_rank_ordered_sum"] <= 1e-5


# -- both reducers on a real two-node cluster --------------------------------------------------------

WORLD = 3  # three ranks (nodes 0, 1, 0): with two, a + b == b + a and the order would not show


@pytest.fixture(scope="module")
def two_nodes():
    """A two-node ``ray.cluster_utils.Cluster`` (one CPU each) for this module only.

    A session's local Ray (the ``ray_local`` fixture) cannot coexist in this process: it is shut
    down here and started again afterwards with the same options as ``tests/conftest.py``.
    """
    import ray
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    node_args = {"num_cpus": 1, "object_store_memory": 100 * 1024**2}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if had_local:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def ranks(two_nodes):
    """``WORLD`` exchange actors over the two nodes, in one gloo group and using two aggregators."""
    import ray

    from hpsray.bench.exchange import Exchanger
    from hpsray.cluster.aggregation import start_aggregators
    from hpsray.cluster.runtime import alive_nodes, on_node

    nodes = [n["NodeID"] for n in alive_nodes()]
    assert len(nodes) == 2
    actor = ray.remote(Exchanger)
    actors = [
        actor.options(num_cpus=0, scheduling_strategy=on_node(nodes[r % 2])).remote(r, WORLD, 1, 0)
        for r in range(WORLD)
    ]
    aggregators = start_aggregators(WORLD, node_ids=nodes, name_prefix="test")
    small = start_aggregators(WORLD, n=3)  # more aggregators than chunks for tiny gradients
    ray.get([a.join_group.remote("test-dense") for a in actors])
    yield {"actors": actors, "aggregators": aggregators, "small": small, "nodes": nodes}
    ray.get([a.leave_group.remote("test-dense") for a in actors])
    for h in actors + aggregators + small:
        ray.kill(h)


_steps = itertools.count()


def exchange(ranks, mode, grads):
    import ray

    step = next(_steps)
    return ray.get([a.reduce_once.remote(mode, g, step) for a, g in zip(ranks["actors"], grads)])


def gradients(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(WORLD)]


@pytest.mark.slow
def test_actors_and_aggregators_sit_on_both_nodes(ranks):
    import ray

    where = ray.get([a.node_id.remote() for a in ranks["actors"]])
    assert where == [ranks["nodes"][r % 2] for r in range(WORLD)]
    assert ray.get(ranks["aggregators"][1].__ray_call__.remote(lambda self: repr(self))) == "Aggregator[node 1]"


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 5, 8191, 8192, 8193, 2 * 8192 + 1, 40_000])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096])
def test_chunked_gives_every_rank_exactly_the_rank_ordered_sum(ranks, n, chunk_bytes):
    import ray

    ray.get([a.use_aggregators.remote(ranks["aggregators"], chunk_bytes, None) for a in ranks["actors"]])
    grads = gradients(n, seed=n)
    expected = rank_ordered_sum(grads)
    for out in exchange(ranks, "chunked", grads):
        assert out.shape == (n,) and np.array_equal(out, expected)
    # gloo sums in its own order: within float rounding, i.e. 1e-6 of the summed magnitudes
    bound = 1e-6 * np.maximum(1.0, np.sum(np.abs(grads), axis=0))
    for out in exchange(ranks, "allreduce", grads):
        assert out.shape == (n,) and np.all(np.abs(out - expected) <= bound)


@pytest.mark.slow
def test_chunked_with_split_messages_and_idle_aggregators(ranks):
    import ray

    # 3 aggregators, 2 chunks: one aggregator idle; then 16-byte messages of 4-byte chunks
    ray.get([a.use_aggregators.remote(ranks["small"], 8, None) for a in ranks["actors"]])
    grads = gradients(3, seed=1)
    for out in exchange(ranks, "chunked", grads):
        assert np.array_equal(out, rank_ordered_sum(grads))
    ray.get([a.use_aggregators.remote(ranks["small"], 4, 16) for a in ranks["actors"]])
    grads = gradients(37, seed=2)
    outs = exchange(ranks, "chunked", grads)
    assert all(np.array_equal(o, rank_ordered_sum(grads)) for o in outs)
    stats = ray.get([h.stats.remote() for h in ranks["small"]])
    assert all(s["open_steps"] == [] for s in stats)
