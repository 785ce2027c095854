"""Chunked aggregation without a cluster: the chunk assignment, the ranks' nodes and summation
order, the streaming engine on real sockets between threads (every topology shape: one rank per
node, several, idle workers, tiny chunks), its failures, and the optimizer at the owners. On a
simulated Ray cluster, with ``hpsray bench exchange``: test_aggregation_cluster.py."""

import copy
import socket
import threading

import numpy as np
import pytest
import torch

from hpsray.cluster.aggregation import (
    DEFAULT_CHUNK_BYTES,
    AllReduceDense,
    ChunkedAggregator,
    ChunkPlan,
    DenseReducer,
    Topology,
    assign_chunks,
    chunk_elements,
    hierarchical_sum,
    n_chunks,
)
from hpsray.cluster.aggregation_mesh import Mesh
from hpsray.cluster.aggregation_stream import StreamEngine

# -- the assignment: a pure function --------------------------------------------------------------


@pytest.mark.parametrize("chunks", [0, 1, 2, 3, 7, 47, 64, 1000, 1001])
@pytest.mark.parametrize("aggs", [1, 2, 3, 5, 8, 64])
def test_every_chunk_has_one_owner_and_counts_differ_by_at_most_one(chunks, aggs):
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
    # the bounds tile [0, n) in slot order, each a whole number of chunks (but the tail)
    edges = [lo for lo, _ in plan.bounds] + [plan.bounds[-1][1]]
    assert edges[0] == 0 and edges[-1] == n and edges == sorted(edges)
    assert all(hi == plan.bounds[a + 1][0] for a, (_, hi) in enumerate(plan.bounds[:-1]))
    per = chunk_elements(chunk_bytes)
    assert all(lo % per == 0 for lo, hi in plan.bounds if hi > lo)
    loads = plan.byte_loads()
    assert sum(loads) == 4 * n
    assert max(loads) - min(loads) <= chunk_bytes
    assert plan.chunk_counts() == np.bincount(plan.owner, minlength=aggs).tolist()


def test_default_chunk_is_32_kib_and_bad_arguments_are_refused():
    assert chunk_elements() == 8192
    for bad in (0, 3, 6, -4):
        with pytest.raises(ValueError, match="chunk_bytes"):
            chunk_elements(bad)
    with pytest.raises(ValueError):
        assign_chunks(3, 0)
    with pytest.raises(ValueError, match="outside world"):
        ChunkedAggregator([object()], world=2, rank=2)
    with pytest.raises(ValueError, match="handles"):
        ChunkedAggregator([], world=2, rank=0)
    with pytest.raises(ValueError, match="lr"):
        ChunkedAggregator([], world=1, rank=0, optimizer="adam")
    with pytest.raises(ValueError, match="unknown dense optimizer"):
        ChunkedAggregator([], world=1, rank=0, optimizer="lion", lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        ChunkedAggregator([], world=1, rank=0).update(torch.ones(3), torch.ones(3), 0)


def test_both_reducers_satisfy_the_protocol():
    assert isinstance(AllReduceDense("g"), DenseReducer)
    assert isinstance(ChunkedAggregator([object()], world=2, rank=0), DenseReducer)


# -- the ranks' nodes and the documented order ------------------------------------------------------


def test_nodes_are_numbered_by_their_lowest_rank_and_stripes_are_contiguous():
    topo = Topology.from_keys(["b", "a", "b", "c", "a"])
    assert topo.node_of == (0, 1, 0, 2, 1) and topo.n_nodes == 3 and topo.world == 5
    assert topo.members(0) == [0, 2] and topo.members(1) == [1, 4] and topo.leader(2) == 3
    plan = topo.plan(100_000, workers=2, chunk_bytes=4096)  # 25 chunks over 6 slots
    assert plan.n_aggregators == 6 and max(plan.chunk_counts()) - min(plan.chunk_counts()) <= 1
    stripes = [topo.stripe(plan, w) for w in range(2)]
    for blocks in stripes:  # a stripe: one contiguous block per node, in node order
        assert len(blocks) == 3 and all(blocks[k][1] == blocks[k + 1][0] for k in range(2))
    assert stripes[0][0][0] == 0 and stripes[0][-1][1] == stripes[1][0][0] and stripes[1][-1][1] == 100_000


def parts_of(world, n, seed):
    rng = np.random.default_rng(seed)
    # magnitudes chosen so float32 addition is not associative: the order shows in the bits
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(world)]


def test_the_documented_order_sums_within_nodes_first():
    g = parts_of(3, 1000, 0)
    assert np.array_equal(hierarchical_sum(g, [0, 1, 2]), (g[0] + g[1]) + g[2])  # one rank per node: rank order
    assert np.array_equal(hierarchical_sum(g, ["x", "y", "x"]), (g[0] + g[2]) + g[1])
    assert not np.array_equal((g[0] + g[2]) + g[1], (g[0] + g[1]) + g[2])  # the orders differ in the bits


# -- the streaming engine on real sockets, ranks as threads -------------------------------------------


def socket_meshes(node_of, workers):
    """Every rank's :class:`Mesh` as ``build_mesh`` makes it, over socket pairs in this process."""
    topo = Topology.from_keys(list(node_of))
    meshes = [
        Mesh(topo, r, workers, [{} for _ in range(workers)], [{} for _ in range(workers)], [{} for _ in range(workers)])
        for r in range(topo.world)
    ]
    for m in meshes:
        m.up = [None] * workers
    for w in range(workers):
        for k in range(topo.n_nodes):
            for j in range(topo.n_nodes):
                if k != j:  # owner k, client j
                    a, b = socket.socketpair()
                    meshes[topo.leader(j)].owner_out[w][k] = a
                    meshes[topo.leader(k)].owner_in[w][j] = b
            for r in topo.members(k)[1:]:
                a, b = socket.socketpair()
                meshes[topo.leader(k)].local[w][r] = a
                meshes[r].up[w] = b
    for m in meshes:
        for s in m.sockets():
            s.setblocking(False)
    return meshes


def run_ranks(engines, step, inputs, params=None, owners=None):
    """Every rank's ``engine.run`` at once (one thread each): results or exceptions, in rank order."""
    outs = [None] * len(engines)

    def go(r):
        try:
            extra = (params.copy(), owners[r]) if owners else ()
            outs[r] = engines[r].run(step, inputs[r], *extra)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            outs[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outs


@pytest.mark.parametrize(
    "node_of",
    [(0,), (0, 1), (0, 1, 2), (0, 1, 0), (0, 0, 1, 2, 1)],
    ids=["1-rank", "2-nodes", "3-nodes", "2-ranks-on-node-0", "5-ranks-on-3-nodes"],
)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_rank_gets_exactly_the_documented_sum(node_of, workers):
    engines = [StreamEngine(m, 4096, timeout_s=20) for m in socket_meshes(node_of, workers)]
    try:
        step = 0
        # lengths around the chunk (1024 values) and the slots: short tails, idle workers
        for n in (0, 1, 5, 1023, 1024, 1025, 7 * 1024 + 3, 40_000):
            parts = parts_of(len(node_of), n, n)
            expected = hierarchical_sum(parts, node_of)
            for out in run_ranks(engines, step, parts):
                assert isinstance(out, np.ndarray) and out.dtype == np.float32 and np.array_equal(out, expected)
            step += 1
    finally:
        for e in engines:
            e.close()


def test_four_byte_chunks_and_more_workers_than_chunks():
    node_of = (0, 1, 0)
    engines = [StreamEngine(m, 4, timeout_s=20) for m in socket_meshes(node_of, 3)]
    for step, n in enumerate((2, 37)):
        parts = parts_of(3, n, step)
        for out in run_ranks(engines, step, parts):
            assert np.array_equal(out, hierarchical_sum(parts, node_of))


def test_ranks_disagreeing_on_step_or_length_fail_all_together():
    engines = [StreamEngine(m, 4096, timeout_s=20) for m in socket_meshes((0, 1, 2), 2)]
    outs = run_ranks(engines, 0, [np.ones(10, np.float32), np.ones(11, np.float32), np.ones(10, np.float32)])
    assert all(isinstance(o, (ValueError, ConnectionError)) for o in outs)
    assert any("n_elements" in str(o) for o in outs)
    with pytest.raises(RuntimeError, match="failed earlier"):  # a broken mesh is not reused
        engines[0].run(1, np.ones(10, np.float32))


def test_a_missing_rank_times_out_and_a_closed_one_fails_its_peers():
    engines = [StreamEngine(m, 4096, timeout_s=0.3) for m in socket_meshes((0, 1), 1)]
    with pytest.raises(TimeoutError, match="node 1"):
        engines[0].run(0, np.ones(10, np.float32))
    engines = [StreamEngine(m, 4096, timeout_s=20) for m in socket_meshes((0, 1, 0), 2)]
    engines[1].close()
    with pytest.raises(ConnectionError, match="closed"):
        engines[0].run(0, np.ones(10, np.float32))


# -- the optimizer at the owners -----------------------------------------------------------------------


def test_reduce_and_update_on_one_rank_need_no_cluster():
    agg = ChunkedAggregator([], world=1, rank=0, chunk_bytes=16)
    flat = torch.arange(11, dtype=torch.float32)
    out = agg.reduce(flat, 0)
    assert torch.equal(out, flat) and out.data_ptr() != flat.data_ptr()
    with pytest.raises(TypeError, match="float32"):
        agg.reduce(flat.double(), 1)


@pytest.mark.parametrize("optimizer,lr", [("adam", 1e-3), ("adagrad", 0.05), ("sgd", 0.1)])
@pytest.mark.parametrize("chunk_bytes,optimizer_bytes", [(DEFAULT_CHUNK_BYTES, 0), (400, 400), (400, 1200)])
def test_owner_side_optimizer_equals_the_replicas_optimizer_bit_for_bit(optimizer, lr, chunk_bytes, optimizer_bytes):
    """One rank, two replicas: the optimizer stepped per chunk of the flat weights ends where the
    replicas' own optimizers over the model's tensors end (the cluster version in
    test_aggregation_cluster.py)."""
    from hpsray.models.dnn import DNN
    from hpsray.models.step import DenseReplicas

    ref = DenseReplicas(DNN(4, 8, 3, (64, 32), seed=0), 2, optimizer, lr)
    ours = DenseReplicas(DNN(4, 8, 3, (64, 32), seed=0), 2, optimizer, lr)
    agg = ChunkedAggregator(
        [], world=1, rank=0, chunk_bytes=chunk_bytes, optimizer=optimizer, lr=lr, optimizer_bytes=optimizer_bytes
    )
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        scale = [10.0 ** torch.randint(-3, 3, p.shape, generator=g) for p in ref.models[0].parameters()]
        grads = [[torch.randn(s.shape, generator=g) * s for s in scale] for _ in ref.models]
        for reps in (ref, ours):
            for model, gs in zip(reps.models, grads):
                for p, gr in zip(model.parameters(), gs):
                    p.grad = gr.clone()
        ref.step_optimizers(lambda flat: flat.clone())  # the replicas' optimizers, as a trainer steps
        agg.step_models(ours.models, step)  # the owners' optimizer
    for model in ref.models[1:] + ours.models:
        for pa, pb in zip(ref.models[0].parameters(), model.parameters()):
            assert torch.equal(pa, pb)
    assert not torch.equal(next(ours.models[0].parameters()), next(DNN(4, 8, 3, (64, 32), seed=0).parameters()))


@pytest.mark.parametrize("node_of,workers", [((0, 1), 1), ((0, 1, 0), 2), ((0, 0, 1, 2, 1), 3)])
def test_owners_stream_back_the_weights_of_one_optimizer_over_the_documented_sum(node_of, workers):
    """Through the engine: each owner steps its segments (3 chunks of 256 values) as they are
    reduced; every rank gets the weights torch's Adam computes from the summed gradient."""
    from hpsray.cluster.aggregation_stream import OwnerOptimizer

    n = 10_000
    engines = [StreamEngine(m, 1024, timeout_s=20) for m in socket_meshes(node_of, workers)]
    owners = [OwnerOptimizer("adam", 0.01, 3 * 256) for _ in node_of]
    ref = torch.nn.Parameter(torch.linspace(-1, 1, n))
    adam = torch.optim.Adam([ref], lr=0.01)
    weights = ref.detach().numpy().copy()
    for step in range(3):
        parts = parts_of(len(node_of), n, step)
        ref.grad = torch.from_numpy(hierarchical_sum(parts, node_of))
        adam.step()
        outs = run_ranks(engines, step, parts, weights, owners)
        for out in outs:
            assert np.array_equal(out, ref.detach().numpy())
        weights = outs[0]
    for e in engines:
        e.close()


def test_the_owners_optimizer_state_continues_from_a_checkpoint():
    def run(agg, params, steps):
        for s in steps:
            params = agg.update(torch.sin(torch.arange(50, dtype=torch.float32) * (s + 1)), params, s)
        return params

    def adam():
        return ChunkedAggregator([], 1, 0, chunk_bytes=64, optimizer="adam", lr=0.1)

    straight = run(adam(), torch.ones(50), range(6))
    first = adam()
    halfway = run(first, torch.ones(50), range(3))
    resumed = adam()
    resumed.load_optimizer_state(first.optimizer_state())
    assert torch.equal(run(resumed, halfway, range(3, 6)), straight)
    assert not torch.equal(run(adam(), halfway, range(3, 6)), straight)  # the state is what made the difference


def test_an_updated_copy_is_not_the_callers_buffer():
    agg = ChunkedAggregator([], world=1, rank=0, optimizer="sgd", lr=1.0)
    params, grad = torch.ones(5), torch.full((5,), 0.5)
    new = agg.update(grad, params, 0)
    assert torch.equal(new, torch.full((5,), 0.5)) and torch.equal(params, torch.ones(5))
    model = copy.deepcopy(torch.nn.Linear(2, 1))
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    before = model.weight.detach().clone()
    agg.step_models([model], 1)
    assert torch.equal(model.weight.detach(), before - 1.0)
