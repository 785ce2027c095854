"""``hpsray bench scale``: throughput on 1, 2, 3 simulated nodes, and a model projecting it to
real clusters (the model: :mod:`hpsray.bench.scale_model`; docs/benchmarks.md, "Scaling model").

The simulated nodes (``ray.cluster_utils.Cluster``) are real Ray nodes sharing this machine's
cores and loopback, so their throughput shows the protocol's overhead, not real hardware's
scaling; the projection takes the stage costs of the 1-node run and the bytes per mini-batch of
the 2-node run. ``--hosts netns``: :mod:`hpsray.bench.scale_hosts`.
"""

from __future__ import annotations

import argparse
import sys

from hpsray.bench.scale_hosts import run_on_hosts
from hpsray.bench.scale_model import factor_for, fit_nodes, speedup, stage_costs, summarize

HELP = "examples/s on 1, 2, 3 simulated nodes, bytes exchanged, and a projection to 4-150 nodes"

PAPER_SPEEDUP_4_NODES = 3.57  # Zhao et al., MLSys 2020: 4 nodes vs 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes",
        default=None,
        help="node counts to measure (default 1,2,3; with --hosts netns --cpus-per-host C, the counts "
        "whose hosts each get C cores of their own here, at least 1,2)",
    )
    parser.add_argument("--rows", type=int, default=30_000, help="training examples per node")
    parser.add_argument("--batch", type=int, default=5_000, help="examples per batch per node")
    parser.add_argument("--minibatch", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--keys", type=int, default=20_000, help="distinct keys per slot")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", default="512,256,128")
    parser.add_argument("--bandwidth-gbps", type=float, default=100.0, help="projected link bandwidth (Gbit/s)")
    parser.add_argument("--latency-us", type=float, default=20.0, help="projected per-message latency")
    parser.add_argument(
        "--gpu-factor",
        type=float,
        default=50.0,
        help="compute speed of a projected GPU node relative to one node measured here",
    )
    parser.add_argument("--project", default="1,2,4,8,16,32,64,150", help="node counts to project")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hosts",
        choices=("simulated", "netns"),
        default="simulated",
        help="netns: measure on network-namespace hosts with shaped links beside the "
        "projection for each link (needs root; docs/benchmarks.md)",
    )
    parser.add_argument(
        "--cpus-per-host",
        type=int,
        default=None,
        help="--hosts netns: pin each host to this many cores of its own (cgroup cpuset, or taskset); "
        "default: the hosts share every core",
    )
    parser.add_argument(
        "--links",
        default="none,10gbit,1gbit,100mbit",
        help="--hosts netns: link shapes, tc rates ('none': unshaped), each optionally "
        "'RATE/DELAYms' (delay needs the kernel's sch_netem)",
    )


def _measure(args: argparse.Namespace, n: int) -> dict:
    from hpsray.cluster.simulated import SimulatedCluster

    with SimulatedCluster(n, cpus_per_node=1):
        return fit_nodes(args, n)


def run(args: argparse.Namespace) -> dict:
    if args.hosts == "netns":
        return run_on_hosts(args)
    counts = [int(x) for x in (args.nodes or "1,2,3").split(",")]
    measured = {}
    for n in counts:
        print(f"[bench scale] {n} simulated node(s) ...", file=sys.stderr, flush=True)
        measured[n] = summarize(_measure(args, n))
    if 1 in measured:
        for n in measured:
            measured[n]["speedup_vs_1"] = measured[n]["examples_per_s"] / measured[1]["examples_per_s"]

    costs = stage_costs(args, measured)
    bw = args.bandwidth_gbps * 1e9 / 8
    lat = args.latency_us * 1e-6
    targets = [int(x) for x in args.project.split(",")]
    projection = {
        "bandwidth_bytes_per_s": bw,
        "latency_s": lat,
        "cpu_node": {str(n): speedup(costs, n, bw, lat, 1.0) for n in targets},
        "gpu_node": {str(n): speedup(costs, n, bw, lat, args.gpu_factor) for n in targets},
        "gpu_factor": args.gpu_factor,
    }
    g = factor_for(costs, PAPER_SPEEDUP_4_NODES, bw, lat)
    return {
        "measured": {str(n): m for n, m in measured.items()},
        "costs_per_batch": costs,
        "projection_speedup": projection,
        "paper_check": {
            "paper_speedup_4_nodes": PAPER_SPEEDUP_4_NODES,
            "model_speedup_4_nodes_gpu": projection["gpu_node"].get("4", speedup(costs, 4, bw, lat, args.gpu_factor)),
            "compute_factor_matching_paper": g,
        },
        "note": "simulated nodes share this machine's cores: measured speedups show protocol overhead, "
        "not hardware scaling; projections follow the model in docs/benchmarks.md",
    }
