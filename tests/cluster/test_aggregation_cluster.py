"""Chunked aggregation on a simulated three-node Ray cluster (``ray.cluster_utils.Cluster``):
four ranks on nodes 0, 1, 2, 0 (node 0 sums its two ranks first), found through the directory
actor, against gloo's all-reduce in the same processes; the optimizer at the owners against
all-reduce + each replica's optimizer, through the trainer's own dense step; and ``hpsray bench
exchange`` on the same cluster."""

import sys

import numpy as np
import pytest
import ray

from hpsray.cluster.aggregation import hierarchical_sum

pytestmark = pytest.mark.slow

# the helpers below run inside the rank actors (``__ray_call__``): pickled with their code
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PLACED = [0, 1, 2, 0]  # rank -> cluster node
WORLD = len(PLACED)


def _join_pair(self, group: str) -> None:
    """Ranks 0 and 1 (nodes 0 and 1) also form a two-rank gloo group of their own."""
    import ray.util.collective as col

    from hpsray.cluster.aggregation import AllReduceDense

    col.init_collective_group(2, self.rank, backend="gloo", group_name=group)
    self.reducers["pair_allreduce"] = AllReduceDense(group)


def _aggregator(self, mode: str, handles: list, world: int, chunk_bytes: int, workers: int, optimizer, lr):
    """A chunked aggregator of ``world`` ranks (this actor's rank), connected, used as ``mode``."""
    from hpsray.cluster.aggregation import ChunkedAggregator

    old = self.reducers.pop(mode, None)
    if old is not None:
        old.close()
    agg = ChunkedAggregator(handles, world, self.rank, chunk_bytes, workers=workers, optimizer=optimizer, lr=lr)
    self.reducers[mode] = agg.connect()
    return agg.topology.node_of


def _train_dense(self, mode: str, world: int, optimizer: str, lr: float, steps: int, owner_side: bool) -> list:
    """``steps`` dense steps of two replicas of a small DNN on this rank's mini-batches, as a
    trainer runs them (:class:`~hpsray.models.step.DenseReplicas`); the dense gradient summed by
    reducer ``mode``, or (``owner_side``) the optimizer stepped by the aggregators."""
    import numpy as np

    from hpsray.data import PlantedCTR
    from hpsray.models.dnn import DNN
    from hpsray.models.step import DenseReplicas

    gen = PlantedCTR(n_slots=4, keys_per_slot=100, n_dense=3, seed=0)
    reps = DenseReplicas(DNN(4, 8, 3, (64, 32), seed=0), 2, optimizer, lr)
    reducer = self.reducers[mode]

    def weights_of(keys):
        k = (keys % np.uint64(1009)).astype(np.float32)
        return (np.sin(k[:, None] * np.arange(1, 9, dtype=np.float32)) * 0.1).astype(np.float32)

    for s in range(steps):
        mb = gen.generate(64, start_row=(s * world + self.rank) * 64)
        if owner_side:  # the trainer change: the owners step, the replicas only take the weights
            reps.step_optimizers = lambda reduce=None, s=s: reducer.step_models(reps.models, s)
            reps.step(mb, weights_of)
        else:
            reps.step(mb, weights_of, reduce=lambda flat, s=s: reducer.reduce(flat, s))
    return [p.detach().numpy().copy() for m in reps.models for p in m.parameters()]


@pytest.fixture(scope="module")
def ranks(three_nodes_cluster):
    from hpsray.bench.exchange import Exchanger
    from hpsray.cluster.aggregation import start_aggregators
    from hpsray.cluster.runtime import alive_nodes, on_node

    nodes = [n["NodeID"] for n in alive_nodes()]
    assert len(nodes) == 3
    actor = ray.remote(Exchanger)
    actors = [
        actor.options(num_cpus=0, scheduling_strategy=on_node(nodes[PLACED[r]])).remote(r, WORLD, 1, 0)
        for r in range(WORLD)
    ]
    directory = start_aggregators(WORLD, node_ids=nodes, name_prefix="test")
    pair = start_aggregators(2, workers=2)
    ray.get([a.join_group.remote("test-dense") for a in actors])
    ray.get([a.__ray_call__.remote(_join_pair, "test-pair") for a in actors[:2]])
    yield {"actors": actors, "directory": directory, "pair": pair, "nodes": nodes}
    for h in actors + directory + pair:
        ray.kill(h)


def aggregator(ranks, mode, chunk_bytes=32768, workers=None, optimizer=None, lr=None, pair=False):
    actors = ranks["actors"][:2] if pair else ranks["actors"]
    handles, world = (ranks["pair"], 2) if pair else (ranks["directory"], WORLD)
    args = (mode, handles, world, chunk_bytes, workers, optimizer, lr)
    return ray.get([a.__ray_call__.remote(_aggregator, *args) for a in actors])


_steps = iter(range(10**9))


def exchange(actors, mode, grads):
    step = next(_steps)
    return ray.get([a.reduce_once.remote(mode, g, step) for a, g in zip(actors, grads)])


def gradients(world, n, seed):
    rng = np.random.default_rng(seed)
    # magnitudes chosen so float32 addition is not associative: the order shows in the bits
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(world)]


def test_ranks_sit_where_placed_and_node_0_leads_two(ranks):
    where = ray.get([a.node_id.remote() for a in ranks["actors"]])
    assert where == [ranks["nodes"][k] for k in PLACED]
    node_of = aggregator(ranks, "chunked")
    assert node_of == [tuple(PLACED)] * WORLD  # every rank sees the same topology, from the directory


@pytest.mark.parametrize("n", [1, 8193, 100_000])
@pytest.mark.parametrize("chunk_bytes", [32768, 4096])
@pytest.mark.parametrize("workers", [1, 2])
def test_every_rank_gets_the_documented_sum_and_gloo_agrees_within_rounding(ranks, n, chunk_bytes, workers):
    aggregator(ranks, "chunked", chunk_bytes, workers)
    grads = gradients(WORLD, n, seed=n + workers)
    expected = hierarchical_sum(grads, PLACED)  # (g0 + g3) + g1 + g2
    for out in exchange(ranks["actors"], "chunked", grads):
        assert out.shape == (n,) and np.array_equal(out, expected)
    bound = 1e-6 * np.maximum(1.0, np.sum(np.abs(grads), axis=0))  # gloo sums in its own order
    for out in exchange(ranks["actors"], "allreduce", grads):
        assert np.all(np.abs(out - expected) <= bound)


def test_on_two_nodes_chunked_equals_gloo_allreduce_bit_for_bit(ranks):
    """With two ranks both orders are ``g0 + g1``: the DNN's 1.5 MB gradient, exactly."""
    aggregator(ranks, "pair_chunked", pair=True)
    grads = gradients(2, 384_513, seed=7)
    chunked = exchange(ranks["actors"][:2], "pair_chunked", grads)
    gloo = exchange(ranks["actors"][:2], "pair_allreduce", grads)
    for out in chunked + gloo:
        assert np.array_equal(out, grads[0] + grads[1])


@pytest.mark.parametrize("optimizer,lr", [("adam", 0.01), ("adagrad", 0.05)])
def test_the_optimizer_at_the_aggregators_ends_where_allreduce_and_replica_optimizers_end(ranks, optimizer, lr):
    """Two nodes: against gloo all-reduce + every replica's optimizer. Four ranks on three nodes:
    against chunked sums + every replica's optimizer (gloo's four-rank order is its own).
    Bit for bit, on every rank and replica."""
    pair, actors = ranks["actors"][:2], ranks["actors"]
    aggregator(ranks, "pair_opt", 4096, optimizer=optimizer, lr=lr, pair=True)
    aggregator(ranks, "all_opt", 4096, workers=2, optimizer=optimizer, lr=lr)
    aggregator(ranks, "all_sum", 4096, workers=2)
    runs = {
        "pair_reference": ray.get(
            [a.__ray_call__.remote(_train_dense, "pair_allreduce", 2, optimizer, lr, 3, False) for a in pair]
        ),
        "pair_owner_side": ray.get(
            [a.__ray_call__.remote(_train_dense, "pair_opt", 2, optimizer, lr, 3, True) for a in pair]
        ),
        "all_reference": ray.get(
            [a.__ray_call__.remote(_train_dense, "all_sum", WORLD, optimizer, lr, 3, False) for a in actors]
        ),
        "all_owner_side": ray.get(
            [a.__ray_call__.remote(_train_dense, "all_opt", WORLD, optimizer, lr, 3, True) for a in actors]
        ),
    }
    for world in ("pair", "all"):
        ref = runs[f"{world}_reference"][0]
        for weights in runs[f"{world}_reference"] + runs[f"{world}_owner_side"]:
            assert all(np.array_equal(a, b) for a, b in zip(ref, weights))
    start = ray.get(pair[0].__ray_call__.remote(_train_dense, "pair_opt", 2, optimizer, lr, 0, True))
    assert not all(np.array_equal(a, b) for a, b in zip(start, runs["pair_reference"][0]))  # it did train


def test_bench_exchange_reports_every_mode_on_the_running_cluster(three_nodes_cluster):
    import argparse

    from hpsray.bench import exchange

    parser = argparse.ArgumentParser()
    exchange.add_arguments(parser)
    # (--optimizer adds two modes, timed the same way; its weights are checked above)
    argv = "--cluster local --steps 5 --warmup 1 --rounds 2 --dense-bytes 40004 --chunk-bytes 4096 --workers 1,2"
    report = exchange.run(parser.parse_args([*argv.split(), "--profile", "5"]))
    assert report["nodes"] == 2 and report["distinct_ray_nodes"] == 2 and report["steps"] == 10
    for mode in ("allreduce", "chunked", "chunked_w2"):
        assert report[mode]["steps_per_s"] > 0 and report[mode]["bytes_per_s"] > 0
    assert report["chunked_vs_allreduce"] > 0 and report["chunked_w2_vs_allreduce"] > 0
    chunked = report["chunked"]
    assert chunked["chunks"] == 10 and chunked["slot_chunk_loads"] == [5, 5] and chunked["workers"] == 1
    assert report["chunked_w2"]["slot_chunk_loads"] == [2, 2, 3, 3]
    assert sum(chunked["slot_byte_loads"]) == report["dense_bytes"] == 40004
    for mode in ("chunked", "chunked_w2"):
        assert report[mode]["bit_identical_across_ranks"] and report[mode]["equals_documented_sum"]
        assert len(report[mode]["profile_top"]) == 5
    assert report["allreduce"]["max_abs_diff_vs_documented_sum"] <= 1e-5
    assert [len(report[m]["vs_allreduce_per_round"]) for m in ("chunked", "chunked_w2")] == [2, 2]
