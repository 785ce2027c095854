"""``hpsray bench exchange``: PHub's zero-compute mode — dense-gradient exchange only.

One exchange actor per node replaces the training step by a no-op and only synchronises a
dense gradient of the model's size, ``--steps`` times, once with the collective all-reduce
(gloo) and once with chunked aggregation (:mod:`hpsray.cluster.aggregation`), alternating in
the same run. This is the ceiling the dense synchronisation puts on training steps per second.

By default it runs on a simulated multi-node cluster (``ray.cluster_utils.Cluster``: ``--nodes``
Ray nodes of one CPU each on this machine); ``--cluster local`` uses the running Ray (or
``--address`` / ``RAY_ADDRESS``, else an embedded local one), one actor per alive node, wrapping
around when there are fewer nodes than ``--nodes``.

Reports per mode ``steps_per_s`` and ``bytes_per_s`` (the *exchange rate*: dense gradient bytes
each trainer gets summed per second), ``chunked_vs_allreduce`` (ratio of steps/s), the chunk
count and each aggregator's chunk and byte loads, and correctness checks: chunked results are
bit-identical on every rank and equal the rank-ordered sum; all-reduce is within float rounding.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid

import numpy as np
import torch

HELP = "dense-gradient exchange only (zero-compute): collective all-reduce vs PHub chunked aggregation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="trainers (one per node)")
    parser.add_argument(
        "--cluster",
        choices=("simulated", "local"),
        default="simulated",
        help="simulated: a ray.cluster_utils.Cluster of --nodes one-CPU nodes on this machine; "
        "local: the running / --address / embedded Ray",
    )
    parser.add_argument("--address", default=None, help="Ray address for --cluster local")
    parser.add_argument("--steps", type=int, default=100, help="timed exchanges per mode and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed exchanges per mode first")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two modes")
    parser.add_argument(
        "--dense-bytes",
        type=int,
        default=None,
        help="gradient bytes (multiple of 4); default: the DNN's dense parameter count x 4",
    )
    parser.add_argument("--slots", type=int, default=26, help="DNN shape for the default size")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--hidden", default="512,256,128")
    parser.add_argument("--chunk-bytes", type=int, default=32 * 1024, help="chunk size of the chunked path")
    parser.add_argument(
        "--message-bytes",
        type=int,
        default=0,
        help="most gradient bytes per aggregator call (whole chunks); 0: one call per aggregator",
    )
    parser.add_argument("--aggregators", type=int, default=None, help="aggregator actors (default: one per node)")
    parser.add_argument("--seed", type=int, default=0)


def dnn_dense_elements(slots: int, dim: int, dense: int, hidden: tuple[int, ...]) -> int:
    """Parameter count of :class:`hpsray.models.dnn.DNN` of that shape (its dense gradient size)."""
    from hpsray.models.dnn import DNN

    return sum(p.numel() for p in DNN(slots, dim, dense, hidden).parameters())


def rank_gradient(n: int, rank: int, seed: int) -> torch.Tensor:
    """The fixed gradient rank ``rank`` contributes (deterministic per seed and rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(n, generator=g, dtype=torch.float32)


class Exchanger:
    """A trainer whose training step is a no-op: it only synchronises its dense gradient."""

    def __init__(self, rank: int, world: int, n_elements: int, seed: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.grad = rank_gradient(n_elements, rank, seed)
        self.reducers: dict = {}

    def __repr__(self) -> str:
        return f"Exchanger[node {self.rank}]"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join_group(self, group_name: str) -> None:
        """Join the gloo collective group (every rank at once) and use it for ``allreduce``."""
        import ray.util.collective as col

        from hpsray.cluster.aggregation import AllReduceDense
        from hpsray.cluster.netaddr import bind_collectives

        bind_collectives("gloo")  # the node's address, not the hostname's (issue 20)
        col.init_collective_group(self.world, self.rank, backend="gloo", group_name=group_name)
        self.reducers["allreduce"] = AllReduceDense(group_name)

    def leave_group(self, group_name: str) -> None:
        import ray.util.collective as col

        col.destroy_collective_group(group_name)

    def use_aggregators(self, handles: list, chunk_bytes: int, message_bytes: int | None) -> int:
        """Use chunked aggregation; returns the pushes per step."""
        from hpsray.cluster.aggregation import ChunkedAggregator

        reducer = ChunkedAggregator(handles, self.world, self.rank, chunk_bytes, message_bytes)
        self.reducers["chunked"] = reducer
        return len(reducer.messages(self.grad.shape[0]))

    def reduce_once(self, mode: str, flat: np.ndarray, step: int) -> np.ndarray:
        """One exchange of a given gradient (for tests): the reduced array."""
        return self.reducers[mode].reduce(torch.from_numpy(np.array(flat, dtype=np.float32)), step).numpy()

    def run(self, mode: str, steps: int, first_step: int) -> dict:
        """``steps`` exchanges; returns the seconds taken, a digest and the last result."""
        reducer = self.reducers[mode]
        out = self.grad
        t0 = time.perf_counter()
        for i in range(steps):
            out = reducer.reduce(self.grad, first_step + i)  # the training step would be here
        seconds = time.perf_counter() - t0
        data = out.numpy()
        return {
            "seconds": seconds,
            "digest": hashlib.sha256(data.tobytes()).hexdigest(),
            "last": data if self.rank == 0 else None,
        }


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.cluster.aggregation import ChunkPlan, start_aggregators
    from hpsray.cluster.runtime import alive_nodes, connect, on_node
    from hpsray.cluster.simulated import SimulatedCluster

    if args.nodes < 1 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("bench exchange: --nodes, --steps, --rounds must be >= 1 and --warmup >= 0")
    hidden = tuple(int(h) for h in args.hidden.split(","))
    if args.dense_bytes is not None:
        if args.dense_bytes < 4 or args.dense_bytes % 4:
            raise SystemExit(f"bench exchange: --dense-bytes must be a positive multiple of 4, got {args.dense_bytes}")
        n = args.dense_bytes // 4
    else:
        n = dnn_dense_elements(args.slots, args.dim, args.dense, hidden)
    world = args.nodes
    n_agg = args.aggregators or world
    plan = ChunkPlan.build(n, n_agg, args.chunk_bytes)

    t_start = time.perf_counter()
    cluster, started = None, False
    print(f"[bench exchange] starting Ray ({args.cluster}, {world} nodes) ...", file=sys.stderr, flush=True)
    if args.cluster == "simulated":
        if ray.is_initialized():
            raise RuntimeError(
                "bench exchange --cluster simulated starts its own Ray cluster; "
                "this process is already connected to Ray (use --cluster local)"
            )
        cluster = SimulatedCluster(world, cpus_per_node=1, object_store_bytes=128 * 1024**2).__enter__()
    else:
        started = connect(args.address, include_dashboard=False, log_to_driver=False)
    actors, aggregators, group = [], [], f"hpsray-exchange-{uuid.uuid4().hex[:8]}"
    try:
        node_ids = [n_["NodeID"] for n_ in alive_nodes()]
        if args.cluster == "simulated" and len(node_ids) < world:
            raise RuntimeError(f"simulated cluster has {len(node_ids)} alive nodes, wanted {world}")
        placed = [node_ids[i % len(node_ids)] for i in range(max(world, n_agg))]
        exchanger = ray.remote(Exchanger)
        actors = [
            exchanger.options(num_cpus=0, scheduling_strategy=on_node(placed[r])).remote(r, world, n, args.seed)
            for r in range(world)
        ]
        aggregators = start_aggregators(world, node_ids=placed[:n_agg])
        ray.get([a.join_group.remote(group) for a in actors])
        message_bytes = args.message_bytes or None
        pushes = ray.get([a.use_aggregators.remote(aggregators, args.chunk_bytes, message_bytes) for a in actors])[0]
        startup_s = time.perf_counter() - t_start

        seconds = {"allreduce": 0.0, "chunked": 0.0}
        results: dict[str, list[dict]] = {}
        step = 0
        for rnd in range(args.rounds):
            order = ("allreduce", "chunked") if rnd % 2 == 0 else ("chunked", "allreduce")
            for mode in order:
                print(f"[bench exchange] round {rnd} {mode} ...", file=sys.stderr, flush=True)
                if args.warmup:
                    ray.get([a.run.remote(mode, args.warmup, step) for a in actors])
                    step += args.warmup
                out = ray.get([a.run.remote(mode, args.steps, step) for a in actors])
                step += args.steps
                seconds[mode] += max(o["seconds"] for o in out)  # a step ends when the slowest rank has it
                results[mode] = out
        ray.get([a.leave_group.remote(group) for a in actors])

        expected = rank_gradient(n, 0, args.seed).numpy().copy()
        for r in range(1, world):
            expected += rank_gradient(n, r, args.seed).numpy()
        chunked_last, allreduce_last = results["chunked"][0]["last"], results["allreduce"][0]["last"]
        distinct_nodes = len(set(placed[:world]))
    finally:
        for h in actors + aggregators:
            ray.kill(h)
        if cluster is not None:
            cluster.__exit__(None, None, None)
        elif started:
            ray.shutdown()

    dense_bytes = n * 4
    total_steps = args.steps * args.rounds

    def mode_report(mode: str) -> dict:
        s = seconds[mode]
        return {
            "steps_per_s": total_steps / s,
            "bytes_per_s": total_steps * dense_bytes / s,
            "step_ms": 1e3 * s / total_steps,
            "seconds": s,
        }

    report = {
        "cluster": args.cluster,
        "nodes": world,
        "distinct_ray_nodes": distinct_nodes,
        "dense_elements": n,
        "dense_bytes": dense_bytes,
        "steps": total_steps,
        "allreduce": mode_report("allreduce"),
        "chunked": mode_report("chunked"),
    }
    report["chunked_vs_allreduce"] = report["chunked"]["steps_per_s"] / report["allreduce"]["steps_per_s"]
    report["chunked"].update(
        {
            "chunk_bytes": args.chunk_bytes,
            "chunks": plan.n_chunks,
            "message_bytes": message_bytes,
            "pushes_per_step": pushes,
            "aggregators": n_agg,
            "aggregator_chunk_loads": plan.chunk_counts(),
            "aggregator_byte_loads": plan.byte_loads(),
            "bit_identical_across_ranks": len({o["digest"] for o in results["chunked"]}) == 1,
            "equals_rank_ordered_sum": bool(np.array_equal(chunked_last, expected)),
        }
    )
    report["allreduce"].update(
        {
            "backend": "gloo",
            "max_abs_diff_vs_rank_ordered_sum": float(np.max(np.abs(allreduce_last - expected))) if n else 0.0,
        }
    )
    report["startup_s"] = startup_s
    report["wall_s"] = time.perf_counter() - t_start
    return report
