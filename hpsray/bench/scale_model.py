"""The scaling model of ``hpsray bench scale`` and the runs that feed it, shared by its two
modes: simulated nodes (:mod:`hpsray.bench.scale`) and namespace hosts
(:mod:`hpsray.bench.scale_hosts`).

The projection takes the per-batch stage costs measured on one
node and the bytes exchanged per mini-batch measured on two, and models a cluster of ``N``
nodes (weak scaling: every node trains its own batch) as

    T(N) = max(read / g, pull / g + remote_pull(N), load / g, train / g + steps * sync(N))
    sync(N) = alpha * ceil(log2 N) + 2 (N-1)/N * dense_bytes / BW + (N-1) * sparse_bytes / BW
    remote_pull(N) = (N-1)/N * distinct_keys * row_bytes / BW
    speedup(N) = N * T(1) / T(N)

with link bandwidth ``BW``, per-message latency ``alpha`` and ``g`` how many times faster a
real node gets through a batch's stages than the one simulated node measured here (a GPU node
with many cores is far faster, which makes the exchange relatively dearer; the network does
not get faster with ``g``). The report gives the projection at ``g = 1`` and at ``--gpu-factor``, and
the ``g`` at which the model reproduces the paper's 3.57x on 4 nodes.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpsray.pipelines import Pipeline
    from hpsray.reference import ShardedSource

__all__ = ["project", "speedup", "factor_for", "fit_nodes", "summarize", "stage_costs"]


def project(costs: dict, n: int, bandwidth: float, latency: float, g: float) -> float:
    """Projected examples/s of ``n`` nodes (see the module docstring); ``costs`` per batch."""
    bw = bandwidth
    sync = 0.0
    if n > 1:
        sync = (
            latency * math.ceil(math.log2(n))
            + 2 * (n - 1) / n * costs["dense_bytes"] / bw
            + (n - 1) * costs["sparse_bytes"] / bw
        )
    remote = (n - 1) / n * costs["distinct_keys"] * costs["row_bytes"] / bw
    t = max(
        costs["read_s"] / g,
        costs["pull_s"] / g + remote,
        costs["load_s"] / g,
        costs["train_s"] / g + costs["steps"] * sync,
    )
    return n * costs["examples"] / t


def speedup(costs: dict, n: int, bandwidth: float, latency: float, g: float) -> float:
    return project(costs, n, bandwidth, latency, g) / project(costs, 1, bandwidth, latency, g)


def factor_for(costs: dict, target: float, bandwidth: float, latency: float) -> float | None:
    """The compute speed factor ``g`` at which 4 projected nodes give ``target`` x one node."""
    lo, hi = 1e-3, 1e6
    if speedup(costs, 4, bandwidth, latency, lo) < target or speedup(costs, 4, bandwidth, latency, hi) > target:
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if speedup(costs, 4, bandwidth, latency, mid) > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def distinct_keys(report: dict) -> float:
    """Mean distinct keys per batch per node: MEM-PS hits + misses count each pulled key once
    (its totals include the one warm-up batch per node)."""
    total = report["cache"]["hits"] + report["cache"]["misses"]
    return total / (report["batches"] + 1) / report["nodes"]


def fit_nodes(args: argparse.Namespace, n: int) -> dict:
    """One warm-up batch per node, then ``args.rows`` examples per node on ``n`` nodes of the
    Ray cluster this process is connected to: the run report."""
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings

    hidden = tuple(int(h) for h in args.hidden.split(","))
    cfg = TrainConfig(dim=args.dim, hidden=hidden, minibatch_size=args.minibatch, seed=args.seed)
    gen = PlantedCTR(n_slots=args.slots, keys_per_slot=args.keys, n_dense=13, seed=args.seed)
    warmup = SyntheticSource(gen, rows=n * args.batch)
    source = SyntheticSource(gen, rows=n * args.rows, start_row=n * args.batch)
    all_rows = args.slots * args.keys + 1024
    with Pipeline(
        warmup, TrainerSettings(cfg, threads=1), MemPSSettings(capacity_rows=all_rows), batch_size=args.batch, nodes=n
    ) as p:
        p.fit(progress=False)
        p.source = source
        report = p.fit(progress=False)
        report["pulls"] = pull_times(p, SyntheticSource(gen, rows=args.batch), args.batch)
        return report


def pull_times(p: Pipeline, source: ShardedSource, batch: int, repeats: int = 3) -> dict:
    """HierPS Fig. 4b: seconds to look up one batch's distinct keys at their owners, from the
    driver (on node 0's host): the owner-0 part (local) and the mean of the others (remote: their
    rows cross the link), each the best of ``repeats`` after training (MEM-PS holds every row)."""
    import time

    import numpy as np
    import ray

    from hpsray.tiers.partition import owner_of

    keys = np.unique(next(iter(source.open(batch, 0, 1))).keys)
    owner = owner_of(keys, len(p._nodes))
    seconds, counts = [], []
    for i, node in enumerate(p._nodes):
        mine = keys[owner == i]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(node.mem.lookup.remote(mine))
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
        counts.append(int(mine.size))
    remote = seconds[1:]
    return {
        "keys_per_owner": counts,
        "local_s": seconds[0],
        "remote_s": sum(remote) / len(remote) if remote else None,
        "per_owner_s": seconds,
    }


def summarize(r: dict) -> dict:
    return {
        "examples_per_s": r["examples_per_s"],
        "speedup_vs_1": None,
        "stage_busy_s": r["stage_busy_s"],
        "pipeline_efficiency": r["pipeline_efficiency"],
        "batches": r["batches"],
        "exchanged_bytes_per_minibatch": r.get("sync", {}).get("exchanged_bytes_per_minibatch", 0.0),
        "distinct_keys_per_batch": distinct_keys(r),
        "pulls": r.get("pulls"),
    }


def stage_costs(args: argparse.Namespace, measured: dict) -> dict:
    """The model's per-batch inputs: stage costs of the smallest run, bytes of the multi-node ones."""
    import numpy as np

    from hpsray.models.dnn import DNN

    hidden = tuple(int(h) for h in args.hidden.split(","))
    dense_bytes = 4 * sum(p.numel() for p in DNN(args.slots, args.dim, 13, hidden).parameters())
    base = measured[min(measured)]
    batches = base["batches"]
    exchanged = [m["exchanged_bytes_per_minibatch"] for n, m in measured.items() if n > 1]
    return {
        "examples": args.batch,
        "read_s": base["stage_busy_s"].get("read", 0.0) / batches,
        "pull_s": base["stage_busy_s"].get("pull", 0.0) / batches,
        "load_s": base["stage_busy_s"].get("load", 0.0) / batches,
        "train_s": base["stage_busy_s"].get("train", 0.0) / batches,
        "steps": math.ceil(args.batch / args.minibatch),
        "dense_bytes": dense_bytes,
        "sparse_bytes": max(float(np.mean(exchanged)) - dense_bytes, 0.0) if exchanged else 0.0,
        "distinct_keys": base["distinct_keys_per_batch"],
        "row_bytes": 4 * 2 * args.dim,
    }
