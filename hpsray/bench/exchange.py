"""``hpsray bench exchange``: PHub's zero-compute mode — dense-gradient exchange only.

One exchange actor per node synchronises a dense gradient of the model's size ``--steps`` times,
with gloo's all-reduce and with streamed chunked aggregation (:mod:`hpsray.cluster.aggregation`),
alternating in one run, on a simulated cluster (default) or the running Ray. Returns per mode
``steps_per_s`` and ``bytes_per_s``, ``chunked_vs_allreduce``, the chunk plan and the correctness
checks; docs/benchmarks.md, section "What each bench measures" (`bench exchange`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import cProfile

    from hpsray.cluster.aggregation import AllReduceDense, ChunkedAggregator
    from hpsray.models.dense_optim import DenseOptimizer

HELP = "dense-gradient exchange only (zero-compute): collective all-reduce vs streamed PHub chunked aggregation"


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
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds of the modes, in a rotating order (load swings hit every mode)"
    )
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
        "--workers",
        default=None,
        help="aggregation workers per node, comma-separated to compare several in the same run "
        "(the first is reported as 'chunked'); default: hpsray.cluster.aggregation.DEFAULT_WORKERS",
    )
    parser.add_argument("--profile", type=int, default=0, help="report the top N functions of rank 0's chunked steps")
    parser.add_argument(
        "--optimizer",
        default=None,
        help="also time a dense optimizer step (adam, adagrad, sgd): all-reduce + the step on every replica "
        "against the step at the owners of chunked aggregation",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate for --optimizer")
    parser.add_argument("--seed", type=int, default=0)


def dnn_dense_elements(slots: int, dim: int, dense: int, hidden: tuple[int, ...]) -> int:
    """Parameter count of :class:`hpsray.models.dnn.DNN` of that shape (its dense gradient size)."""
    from hpsray.models.dnn import DNN

    return sum(p.numel() for p in DNN(slots, dim, dense, hidden).parameters())


def rank_gradient(n: int, rank: int, seed: int) -> torch.Tensor:
    """The fixed gradient rank ``rank`` contributes (deterministic per seed and rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(n, generator=g, dtype=torch.float32)


def _top(profile: cProfile.Profile, n: int) -> list[dict]:
    import pstats

    stats = pstats.Stats(profile)
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file.rsplit('/', 1)[-1]}:{line}({func})" if line else func
        rows.append({"function": where, "calls": calls, "tottime_s": tottime, "cumtime_s": cumtime})
    return sorted(rows, key=lambda r: -r["tottime_s"])[:n]


class _ReplicaStep:
    """All-reduce, then this replica's own optimizer step; ``reduce`` returns the weights."""

    def __init__(self, allreduce: AllReduceDense, weights: torch.nn.Parameter, optimizer: DenseOptimizer) -> None:
        self.allreduce, self.weights, self.optimizer = allreduce, weights, optimizer

    def reduce(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        self.weights.grad = self.allreduce.reduce(grad, step)
        self.optimizer.step()
        return self.weights.detach()


class _OwnerStep:
    """The optimizer at the owners (:meth:`ChunkedAggregator.update`); ``reduce`` returns the weights."""

    def __init__(self, agg: ChunkedAggregator, weights: torch.Tensor) -> None:
        self.agg, self.weights = agg, weights

    def reduce(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        self.weights = self.agg.update(grad, self.weights, step)
        return self.weights


class Exchanger:
    """A trainer whose training step is a no-op: it only synchronises its dense gradient."""

    def __init__(self, rank: int, world: int, n_elements: int, seed: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.grad = rank_gradient(n_elements, rank, seed)
        self.reducers: dict[str, Any] = {}  # mode -> a reducer (AllReduceDense, ChunkedAggregator, ...)

    def __repr__(self) -> str:
        return f"Exchanger[node {self.rank}]"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join_group(self, group_name: str) -> None:
        """Join the gloo collective group (every rank at once) and use it for ``allreduce``."""
        import ray.util.collective as col
        from ray.util.collective.types import Backend

        from hpsray.cluster.aggregation import AllReduceDense
        from hpsray.cluster.netaddr import bind_collectives

        bind_collectives("gloo")  # the node's address, not the hostname's (issue 20)
        col.init_collective_group(self.world, self.rank, backend=Backend("gloo"), group_name=group_name)
        self.reducers["allreduce"] = AllReduceDense(group_name)

    def leave_group(self, group_name: str) -> None:
        import ray.util.collective as col

        col.destroy_collective_group(group_name)

    def use_aggregators(
        self, handles: list, chunk_bytes: int, workers: int | None = None, mode: str = "chunked"
    ) -> dict:
        """Connect a chunked aggregator (every rank at once) used as ``mode``; returns its plan."""
        from hpsray.cluster.aggregation import ChunkedAggregator

        old = self.reducers.pop(mode, None)
        if old is not None:
            old.close()
        reducer = ChunkedAggregator(handles, self.world, self.rank, chunk_bytes, workers=workers).connect()
        self.reducers[mode] = reducer
        plan = reducer.plan(self.grad.shape[0])
        return {
            "workers": reducer.workers_per_node,
            "nodes": reducer.topology.n_nodes,
            "chunks": plan.n_chunks,
            "slot_chunk_loads": plan.chunk_counts(),
            "slot_byte_loads": plan.byte_loads(),
        }

    def use_optimizer(self, handles: list, chunk_bytes: int, workers: int | None, name: str, lr: float) -> list[str]:
        """Add the modes ``allreduce+NAME`` (gloo, then the optimizer on this replica) and
        ``chunked+NAME`` (the optimizer at the owners); both start from the same weights."""
        from hpsray.cluster.aggregation import ChunkedAggregator
        from hpsray.models.dnn import make_dense_optimizer

        start = torch.linspace(-1.0, 1.0, self.grad.shape[0])
        weights = torch.nn.Parameter(start.clone())
        replica = _ReplicaStep(self.reducers["allreduce"], weights, make_dense_optimizer(name, [weights], lr))
        agg = ChunkedAggregator(handles, self.world, self.rank, chunk_bytes, workers=workers, optimizer=name, lr=lr)
        self.reducers[f"allreduce+{name}"] = replica
        self.reducers[f"chunked+{name}"] = _OwnerStep(agg.connect(), start.clone())
        return [f"allreduce+{name}", f"chunked+{name}"]

    def reduce_once(self, mode: str, flat: np.ndarray, step: int) -> np.ndarray:
        """One exchange of a given gradient (for tests): the reduced array."""
        return self.reducers[mode].reduce(torch.from_numpy(np.array(flat, dtype=np.float32)), step).numpy()

    def run(self, mode: str, steps: int, first_step: int, profile: int = 0) -> dict:
        """``steps`` exchanges; returns the seconds taken, a digest, the last result and, with
        ``profile``, that many of the steps' functions with the most own time (cProfile)."""
        reducer = self.reducers[mode]
        out = self.grad
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for i in range(steps):
            out = reducer.reduce(self.grad, first_step + i)  # the training step would be here
        seconds = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        data = out.numpy()
        return {
            "seconds": seconds,
            "digest": hashlib.sha256(data.tobytes()).hexdigest(),
            "last": data if self.rank == 0 else None,
            "profile": _top(prof, profile) if prof is not None else None,
        }


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.cluster.aggregation import DEFAULT_WORKERS, hierarchical_sum, start_aggregators
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
    workers = [int(w) for w in str(args.workers).split(",")] if args.workers else [DEFAULT_WORKERS]
    if min(workers) < 1:
        raise SystemExit("bench exchange: --workers must be >= 1")
    chunked = {w: ("chunked" if i == 0 else f"chunked_w{w}") for i, w in enumerate(dict.fromkeys(workers))}
    world = args.nodes

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
        placed = [node_ids[i % len(node_ids)] for i in range(world)]
        exchanger: Any = ray.remote(Exchanger)  # an actor class
        actors = [
            exchanger.options(num_cpus=0, scheduling_strategy=on_node(placed[r])).remote(r, world, n, args.seed)
            for r in range(world)
        ]
        aggregators = start_aggregators(world, node_ids=placed)
        ray.get([a.join_group.remote(group) for a in actors])
        plans = {}
        for w, mode in chunked.items():
            plans[mode] = ray.get([a.use_aggregators.remote(aggregators, args.chunk_bytes, w, mode) for a in actors])[0]
        opt_modes = []
        if args.optimizer:
            first_w = next(iter(chunked))
            call = [
                a.use_optimizer.remote(aggregators, args.chunk_bytes, first_w, args.optimizer, args.lr) for a in actors
            ]
            opt_modes = ray.get(call)[0]
        startup_s = time.perf_counter() - t_start

        modes = ["allreduce", *chunked.values(), *opt_modes]
        seconds = dict.fromkeys(modes, 0.0)
        results: dict[str, list[dict]] = {}
        profiles: dict[str, list] = {}
        per_round: dict[str, list[float]] = {}
        step = 0
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]  # every mode in every slot
            for mode in order:
                print(f"[bench exchange] round {rnd} {mode} ...", file=sys.stderr, flush=True)
                if args.warmup:
                    ray.get([a.run.remote(mode, args.warmup, step) for a in actors])
                    step += args.warmup
                prof = args.profile if mode.startswith("chunked") else 0
                out = ray.get([a.run.remote(mode, args.steps, step, 0 if r else prof) for r, a in enumerate(actors)])
                step += args.steps
                took = max(o["seconds"] for o in out)  # a step ends when the slowest rank has it
                seconds[mode] += took
                per_round.setdefault(mode, []).append(took)
                results[mode] = out
                if out[0]["profile"]:
                    profiles.setdefault(mode, []).append(out[0]["profile"])
        ray.get([a.leave_group.remote(group) for a in actors])

        grads = [rank_gradient(n, r, args.seed).numpy() for r in range(world)]
        expected = hierarchical_sum(grads, placed)
        distinct_nodes = len(set(placed))
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

    report: dict = {
        "cluster": args.cluster,
        "nodes": world,
        "distinct_ray_nodes": distinct_nodes,
        "dense_elements": n,
        "dense_bytes": dense_bytes,
        "steps": total_steps,
    }
    allreduce_last = results["allreduce"][0]["last"]
    report["allreduce"] = {
        **mode_report("allreduce"),
        "backend": "gloo",
        "max_abs_diff_vs_documented_sum": float(np.max(np.abs(allreduce_last - expected))) if n else 0.0,
    }
    for mode in chunked.values():
        report[mode] = {
            **mode_report(mode),
            "chunk_bytes": args.chunk_bytes,
            **plans[mode],
            "bit_identical_across_ranks": len({o["digest"] for o in results[mode]}) == 1,
            "equals_documented_sum": bool(np.array_equal(results[mode][0]["last"], expected)),
        }
        if mode in profiles:
            report[mode]["profile_top"] = profiles[mode][-1]
        key = "chunked_vs_allreduce" if mode == "chunked" else f"{mode}_vs_allreduce"
        report[key] = report[mode]["steps_per_s"] / report["allreduce"]["steps_per_s"]
        # the same ratio per round (both modes timed back to back): how much the load moved it
        report[mode]["vs_allreduce_per_round"] = [a / c for a, c in zip(per_round["allreduce"], per_round[mode])]
    if opt_modes:
        replica, owner = opt_modes
        report[replica] = {**mode_report(replica), "optimizer": args.optimizer, "lr": args.lr}
        report[owner] = {
            **mode_report(owner),
            "optimizer": args.optimizer,
            "lr": args.lr,
            "bit_identical_across_ranks": len({o["digest"] for o in results[owner]}) == 1,
        }
        if world == 2:  # gloo's sum of two is the documented one: the weights must match bit for bit
            same = np.array_equal(results[owner][0]["last"], results[replica][0]["last"])
            report[owner]["equals_replica_weights"] = bool(same)
        report[f"{owner}_vs_{replica}"] = report[owner]["steps_per_s"] / report[replica]["steps_per_s"]
    report["startup_s"] = startup_s
    report["wall_s"] = time.perf_counter() - t_start
    return report
