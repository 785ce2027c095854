"""``hpsray bench consistency``: Lapser's experiment — BSP, A-BSP, SSP and ASP with a straggler.

Every mode trains the same planted data for ``--passes`` passes on a simulated cluster (or, with
``--hosts netns``, namespace hosts) with one straggler node meeting the same seeded delays;
held-out AUC after each pass gives AUC against training time. Returns per mode the wall time,
the time to the target AUC, final AUC, the largest staleness against its bound, payload bytes
per mini-batch and the ratios to BSP; docs/benchmarks.md, section "What each bench measures"
(`bench consistency`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR

HELP = "BSP, A-BSP, SSP(1/2/4/8, push and pull) and ASP with a straggler node: time to a target AUC"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="simulated Ray nodes")
    parser.add_argument("--rows", type=int, default=24_000, help="training examples per pass (all nodes)")
    parser.add_argument("--passes", type=int, default=4, help="passes over the data (an AUC point after each)")
    parser.add_argument("--batch", type=int, default=6_000, help="examples per batch per node")
    parser.add_argument("--minibatch", type=int, default=256)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--keys", type=int, default=2_000, help="distinct keys per slot")
    parser.add_argument("--dense", type=int, default=4)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", default="32,16")
    parser.add_argument("--eval-rows", type=int, default=10_000)
    parser.add_argument("--delay", type=float, default=0.02, help="straggler's mean delay per delayed mini-batch (s)")
    parser.add_argument("--probability", type=float, default=0.5, help="share of the straggler's mini-batches delayed")
    parser.add_argument("--straggler", type=int, default=1, help="the straggler node")
    parser.add_argument("--slacks", default="1,2,4,8", help="SSP slacks to measure")
    parser.add_argument("--propagations", default="push,pull", help="SSP/A-BSP/ASP propagation variants")
    parser.add_argument("--work-per-clock", type=int, default=4, help="A-BSP: mini-batches per clock")
    parser.add_argument("--target-auc", type=float, default=None, help="default: BSP's final AUC - --target-margin")
    parser.add_argument("--target-margin", type=float, default=0.005)
    parser.add_argument("--modes", default=None, help="only these modes (e.g. bsp,ssp4-push,asp-pull)")
    parser.add_argument("--plot", default=None, help="PNG of AUC against time (default: beside --out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hosts", choices=("simulated", "netns"), default="simulated", help="netns: namespace hosts (needs root)"
    )
    parser.add_argument(
        "--cpus-per-host", type=int, default=None, help="--hosts netns: cores of its own per host (cpuset or taskset)"
    )
    parser.add_argument(
        "--busy-loops", type=int, default=1, help="--hosts netns: busy loops on the straggler host's cores"
    )


def mode_list(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """``(name, SyncSettings keyword arguments)`` of every mode to measure, BSP first."""
    props = [p for p in args.propagations.split(",") if p]
    modes: list[tuple[str, dict]] = [("bsp", {"consistency": "bsp"})]
    for p in props:
        modes.append(
            (
                f"absp{args.work_per_clock}-{p}",
                {"consistency": "absp", "work_per_clock": args.work_per_clock, "propagation": p},
            )
        )
    for s in (int(x) for x in args.slacks.split(",") if x):
        for p in props:
            modes.append((f"ssp{s}-{p}", {"consistency": "ssp", "staleness": s, "propagation": p}))
    for p in props:
        modes.append((f"asp-{p}", {"consistency": "asp", "propagation": p}))
    if args.modes:
        wanted = set(args.modes.split(","))
        modes = [m for m in modes if m[0] in wanted or m[0] == "bsp"]
    return modes


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time the AUC curve (linear between points, from (0, 0.5)) reaches ``target``."""
    prev_t, prev_auc = 0.0, 0.5
    for t, auc in points:
        if auc >= target:
            if auc == prev_auc:
                return t
            return prev_t + (t - prev_t) * (target - prev_auc) / (auc - prev_auc)
        prev_t, prev_auc = t, auc
    return None


def _train(args: argparse.Namespace, gen: PlantedCTR, cfg: TrainConfig, sync_kw: dict) -> dict:
    from hpsray.pipelines import MemPSSettings, Pipeline, SyncSettings, SyntheticSource, TrainerSettings

    sync = SyncSettings(
        **sync_kw,
        straggler_delay_s=args.delay,
        straggler_node=args.straggler,
        straggler_probability=args.probability,
        straggler_seed=args.seed,
    )
    train = SyntheticSource(gen, rows=args.rows)
    held_out = SyntheticSource(gen, rows=args.eval_rows, start_row=10**9)
    points, elapsed, staleness, sent, minibatches = [], 0.0, 0, [], 0
    mem_rows = args.slots * args.keys  # every row fits: the bench measures consistency, not the tiers
    with Pipeline(
        train,
        TrainerSettings(cfg, threads=1),
        MemPSSettings(capacity_rows=mem_rows),
        batch_size=args.batch,
        nodes=args.nodes,
        sync=sync,
    ) as p:
        for _ in range(args.passes):
            report = p.fit(progress=False)
            elapsed += report["wall_s"]
            points.append((elapsed, float(p.evaluate(held_out)["auc"])))
            staleness = max(staleness, report["sync"]["max_staleness_observed"])
            sent.append(report["sync"]["exchanged_bytes_per_minibatch"])
    per_node_minibatches = -(-args.rows // args.nodes // args.minibatch)
    minibatches = per_node_minibatches * args.passes
    return {
        "sync": sync_kw,
        "slack": sync.slack,
        "wall_s": elapsed,
        "auc_points": [[round(t, 4), round(a, 5)] for t, a in points],
        "final_auc": points[-1][1],
        "max_staleness": staleness,
        "bytes_received_per_minibatch": float(sum(sent) / len(sent)) if sent else 0.0,
        "minibatches_per_node": minibatches,
    }


def plot(results: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        ts = [0.0] + [t for t, _ in r["auc_points"]]
        aucs = [0.5] + [a for _, a in r["auc_points"]]
        ax.plot(ts, aucs, marker="o", markersize=3, label=name, linewidth=2.2 if name == "bsp" else 1.2)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.4f}")
    lo = min(a for r in results.values() for _, a in r["auc_points"])
    ax.set_ylim(max(0.5, lo - 0.02), None)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("held-out AUC")
    ax.set_title("hpsray bench consistency: AUC against time, one straggler node")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _job(args: argparse.Namespace) -> tuple[PlantedCTR, TrainConfig]:
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR

    hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    cfg = TrainConfig(dim=args.dim, hidden=hidden, minibatch_size=args.minibatch, seed=args.seed, sparse_lr=0.1)
    gen = PlantedCTR(n_slots=args.slots, keys_per_slot=args.keys, n_dense=args.dense, seed=args.seed)
    return gen, cfg


def _on_hosts(args: argparse.Namespace) -> tuple[dict, dict]:
    """Every mode on namespace hosts, each run's driver inside host 0; the results and the hosts' setup."""
    import json

    from hpsray.cluster.netns import NetnsHosts

    results: dict = {}
    pinned = args.cpus_per_host is not None
    with NetnsHosts(args.nodes, cpus_per_host=args.cpus_per_host or 1, pin=pinned) as hosts:
        loops = hosts.busy(args.straggler, args.busy_loops) if args.busy_loops > 0 else []
        try:
            for name, kw in mode_list(args):
                print(f"[bench consistency] {name} on namespace hosts ...", file=sys.stderr, flush=True)
                spec = json.dumps({"args": {k: v for k, v in vars(args).items() if _plain(v)}, "sync": kw})
                out = hosts.run(
                    0,
                    [sys.executable, "-m", "hpsray.bench.consistency", spec],
                    timeout=3600,
                    env=hosts.env(RAY_ADDRESS=hosts.address),
                )
                if out.returncode != 0:
                    raise RuntimeError(f"mode {name} on the namespace hosts failed:\n{out.stderr[-4000:]}")
                results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        setup = {"host_cpus": hosts.cpus, "pinning": hosts.pinning, "busy_loops_on_straggler": args.busy_loops}
    return results, setup


def _plain(v: object) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    hosts_setup: dict = {"hosts": args.hosts}
    if args.hosts == "netns":
        results, more = _on_hosts(args)
        hosts_setup.update(more)
    else:
        from hpsray.cluster.simulated import SimulatedCluster

        gen, cfg = _job(args)
        results = {}
        with SimulatedCluster(args.nodes, cpus_per_node=1):
            for name, kw in mode_list(args):
                print(f"[bench consistency] {name} ...", file=sys.stderr, flush=True)
                results[name] = _train(args, gen, cfg, kw)
    bsp = results["bsp"]
    target = args.target_auc if args.target_auc is not None else bsp["final_auc"] - args.target_margin
    bsp_time = time_to(bsp["auc_points"], target)
    for r in results.values():
        r["time_to_target_s"] = time_to(r["auc_points"], target)
        r["time_to_target_vs_bsp"] = (
            r["time_to_target_s"] / bsp_time if r["time_to_target_s"] is not None and bsp_time else None
        )
        r["wall_vs_bsp"] = r["wall_s"] / bsp["wall_s"] if bsp["wall_s"] else None
        r["auc_vs_bsp"] = r["final_auc"] - bsp["final_auc"]
        r["within_bound"] = r["slack"] is None or r["max_staleness"] <= r["slack"]
    if args.plot:
        path = args.plot
    elif args.out:
        path = os.path.splitext(args.out)[0] + ".png"
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="hpsray-bench-consistency-"), "auc.png")
    plot(results, target, path)
    reached = {n: r["time_to_target_vs_bsp"] for n, r in results.items() if r["time_to_target_vs_bsp"] is not None}
    fastest = min(reached, key=reached.__getitem__) if reached else None
    relaxed = {n: t for n, t in reached.items() if n != "bsp"}
    return {
        "best_relaxed_time_vs_bsp": min(relaxed.values()) if relaxed else None,
        "best_relaxed_mode": min(relaxed, key=lambda n: relaxed[n]) if relaxed else None,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "setup": {
            **hosts_setup,
            "cpus_per_host": args.cpus_per_host,
            "nodes": args.nodes,
            "rows_per_pass": args.rows,
            "passes": args.passes,
            "batch": args.batch,
            "minibatch": args.minibatch,
            "straggler": {
                "node": args.straggler,
                "mean_delay_s": args.delay,
                "probability": args.probability,
                "seed": args.seed,
            },
        },
        "target_auc": target,
        "modes": results,
        "fastest_to_target": fastest,
        "plot": path,
    }


def _main(spec: str) -> None:
    """Driver side (inside host 0): train one mode on the cluster at ``RAY_ADDRESS``, print its result."""
    import json

    import ray

    fields = json.loads(spec)
    args = argparse.Namespace(**fields["args"])
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    gen, cfg = _job(args)
    print(json.dumps(_train(args, gen, cfg, fields["sync"])))


if __name__ == "__main__":
    _main(sys.argv[1])
