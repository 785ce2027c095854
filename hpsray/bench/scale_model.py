"""The scaling model of ``hpsray bench scale`` and the runs that feed it, shared by its two
modes: simulated nodes (:mod:`hpsray.bench.scale`) and namespace hosts
(:mod:`hpsray.bench.scale_hosts`).

The projection takes the per-batch stage costs measured on one node and the bytes exchanged
per mini-batch measured on two, and models a cluster of ``N`` nodes (weak scaling: every node
trains its own batch) as

    T(N) = max(read / g, pull / g + remote_pull(N), load / g, train / g + steps * sync(N))
    sync(N) = alpha * ceil(log2 N) + 2 (N-1)/N * dense_bytes / BW + (N-1) * sparse_bytes / BW
    remote_pull(N) = (N-1)/N * distinct_keys * row_bytes / BW
    speedup(N) = N * T(1) / T(N)

with link bandwidth ``BW``, per-message latency ``alpha`` and ``g`` how many times faster a
real node gets through a batch's stages than the one simulated node measured here (a GPU node
with many cores is far faster, which makes the exchange relatively dearer; the network does
not get faster with ``g``). The report gives the projection at ``g = 1`` and at ``--gpu-factor``, and
the ``g`` at which the model reproduces the paper's 3.57x on 4 nodes.

On hosts with ``c`` cores of their own (``--hosts netns --cpus-per-host c``) the model also
knows what the one-node run spent and what the exchange costs on the link being tried
(:mod:`hpsray.bench.scale_probe`: one mini-batch's collectives, ``round``, and one owner's rows
of a batch crossing as a Ray object, ``transfer``, each in wall and CPU seconds). Then

    T(N) = max(path(N), cpu(N) / c)
    path(N) = (P - I) / g + steps * round(N) + 2 * transfer(N) + I / g * hits(N)
    cpu(N)  = H / g + steps * round_cpu(N) + 3 * transfer_cpu(N)
    hits(N) = m * (1 - (1 - 1/m) ** N),  m = steps
    I = max(H - X - (c - 1) * P, 0)

with ``P`` the one-node run's seconds per batch, ``H`` its host's CPU seconds per batch (every
process on its cores), ``X`` its trainer's. The trainer's path is the one-node period plus what
the link adds: each mini-batch's collectives, and between batches the write-back to the owners
and the refresh from them (two transfers); the host's CPU adds the collectives and three
transfers (loan, write-back, refresh). ``I`` is the CPU of the other stages that does not fit
on the host's other cores, so it interrupts the trainer; one node pays it once (``hits(1) =
1``), but ``N`` trainers meet ``m`` times a batch, so each host's interruption stalls every
trainer in the stretch it falls in: if it falls in one of the ``m`` stretches at random, ``hits``
counts the stretches hit. ``round(N)``, ``transfer(N)`` and their CPU are the probe's (on two
hosts) scaled by the formula's byte counts, ``sync(N) / sync(2)`` and ``2 (N-1) / N``.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpsray.pipelines import Pipeline
    from hpsray.reference import ShardedSource

__all__ = [
    "project",
    "project_on_cores",
    "terms_on_cores",
    "hits",
    "speedup",
    "factor_for",
    "fit_nodes",
    "summarize",
    "stage_costs",
]


def _sync(costs: dict, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of one mini-batch's exchange among ``n`` nodes (the module docstring's ``sync``)."""
    if n <= 1:
        return 0.0
    return (
        latency * math.ceil(math.log2(n))
        + 2 * (n - 1) / n * costs["dense_bytes"] / bandwidth
        + (n - 1) * costs["sparse_bytes"] / bandwidth
    )


def hits(n: int, m: int) -> float:
    """Expected stretches (of ``m`` between a batch's meeting points) that ``n`` hosts'
    interruptions fall in, each host's in one at random: 1 for one host, at most ``m``."""
    m = max(m, 1)
    return m * (1 - (1 - 1 / m) ** n)


def terms_on_cores(costs: dict, n: int, bandwidth: float, latency: float, g: float) -> dict:
    """The module docstring's ``path``, ``cpu`` (both seconds per batch), ``interrupt`` (``I``)
    and ``hits`` for ``n`` hosts with cores of their own and the exchange probe's costs."""
    probe, cores, steps = costs["probe"], costs["cores"], costs["steps"]
    period, host, trainer = costs["period_s"], costs["host_cpu_s"], costs["trainer_cpu_s"]
    interrupt = max(host - trainer - (cores - 1) * period, 0.0)
    per_sync = _sync(costs, n, bandwidth, latency) / _sync(costs, 2, bandwidth, latency)
    per_row = 2 * (n - 1) / n
    path = (
        (period - interrupt) / g
        + steps * probe["round_s"] * per_sync
        + 2 * probe["transfer_s"] * per_row
        + interrupt / g * hits(n, steps)
    )
    cpu = host / g + steps * probe["round_cpu_s"] * per_sync + 3 * probe["transfer_cpu_s"] * per_row
    return {"path_s": path, "cpu_s": cpu, "cores": cores, "interrupt_s": interrupt, "hits": hits(n, steps)}


def project_on_cores(costs: dict, n: int, bandwidth: float, latency: float, g: float) -> float:
    """Projected examples/s of ``n`` hosts with cores of their own (:func:`terms_on_cores`)."""
    t = terms_on_cores(costs, n, bandwidth, latency, g)
    return n * costs["examples"] / max(t["path_s"], t["cpu_s"] / t["cores"])


def project(costs: dict, n: int, bandwidth: float, latency: float, g: float) -> float:
    """Projected examples/s of ``n`` nodes (see the module docstring); ``costs`` per batch:
    :func:`project_on_cores` where they hold the exchange probe's and the host's CPU."""
    if costs.get("probe") and costs.get("host_cpu_s") is not None and costs["probe"].get("round_cpu_s") is not None:
        return project_on_cores(costs, n, bandwidth, latency, g)
    bw = bandwidth
    sync = _sync(costs, n, bandwidth, latency)
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
    Ray cluster this process is connected to: the run report, with ``host_cpu_s`` (busy CPU
    seconds of host 0's cores ``args.host_cpus[0]`` during the timed pass; ``None`` without
    them) and ``trainer_cpu_s`` (node 0's trainer process's)."""
    import ray

    from hpsray.bench.scale_probe import host_cpu_seconds
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
        cpus = (getattr(args, "host_cpus", None) or [None])[0]
        trainer = p.actors()["Trainer[node 0]"]
        cpu0, trainer0 = host_cpu_seconds(cpus or []), ray.get(trainer.stats.remote())["process_cpu_s"]
        report = p.fit(progress=False)
        report["trainer_cpu_s"] = ray.get(trainer.stats.remote())["process_cpu_s"] - trainer0
        report["host_cpu_s"] = host_cpu_seconds(cpus) - cpu0 if cpus else None
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
        "seconds_per_batch": r["wall_s"] / r["batches"] if r.get("wall_s") else None,
        "host_cpu_s": r.get("host_cpu_s"),
        "trainer_cpu_s": r.get("trainer_cpu_s"),
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
        "period_s": base.get("seconds_per_batch") or args.batch / base["examples_per_s"],
        "host_cpu_s": base["host_cpu_s"] / batches if base.get("host_cpu_s") is not None else None,
        "trainer_cpu_s": base["trainer_cpu_s"] / batches if base.get("trainer_cpu_s") is not None else None,
        "cores": getattr(args, "cpus_per_host", None) or 1,
    }
