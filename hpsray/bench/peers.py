"""``hpsray bench peers``: hpsray beside the systems it replaces, same model, data and optimizers.

For 26 and 100 keys per example, each system (``hpsray_in_memory``, ``hpsray_ssd``, ``pytorch``,
``torchrec``, ``sharded_ps``, and the dense bound ``mlp_alone``) trains the same stored
mini-batches in its own process. Returns per system ``examples_per_s``, held-out ``auc`` and
``peak_rss_bytes``, and the ratios between them (target ``hpsray_in_memory_vs_pytorch >= 1.0``
at equal AUC). The systems and what is timed: docs/benchmarks.md, section "What each bench
measures" (`bench peers`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from hpsray.bench.baselines import PeerSpec
from hpsray.bench.peer_process import CEILING
from hpsray.first_order import FIRST_ORDER_KINDS
from hpsray.models.kinds import MODEL_KINDS, ModelSpec

HELP = "hpsray vs plain PyTorch, TorchRec and an in-memory sharded PS (same model, data, optimizers)"

SYSTEMS = ("hpsray_in_memory", "hpsray_ssd", "pytorch", "torchrec", "sharded_ps")
RUNNABLE = (*SYSTEMS, CEILING)  # what --systems accepts
AUC_TOLERANCE = 0.002
REPO = Path(__file__).resolve().parents[2]
DEFAULT_TORCHREC_VENV = REPO / "benchmarks" / ".torchrec-venv"
TORCHREC_RUNNER = REPO / "benchmarks" / "torchrec_peer.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keys-per-example",
        default="26,100",
        help="comma-separated sizes; each is one run of every system (default 26,100)",
    )
    parser.add_argument("--systems", default=",".join(RUNNABLE), help=f"subset of {','.join(RUNNABLE)} (default: all)")
    parser.add_argument(
        "--size",
        type=float,
        default=1.0,
        help="scale of --rows, --warmup-rows and --eval-rows (default 1.0: ~4 min a round on 2 cores)",
    )
    parser.add_argument("--rows", type=int, default=131_072, help="timed training examples (times --size)")
    parser.add_argument("--warmup-rows", type=int, default=32_768, help="untimed examples first (times --size)")
    parser.add_argument("--eval-rows", type=int, default=32_768, help="held-out examples for AUC (times --size)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every system, round-robin; the fastest counts (all rates are listed)",
    )
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--keys", type=int, default=100_000, help="distinct keys per slot (table rows = slots × keys)")
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", default="512,256,128", help="MLP widths of --model mlp")
    parser.add_argument(
        "--model",
        default="mlp",
        choices=[k for k in MODEL_KINDS if k not in FIRST_ORDER_KINDS],  # the peers have no first-order tables
        help="the dense model every system trains, with its kind's default settings (docs/models.md); "
        "TorchRec runs its own torchrec.models.dlrm.DLRM for dlrm",
    )
    parser.add_argument("--minibatch", type=int, default=4096, help="examples per gradient step (every system)")
    parser.add_argument("--batch", type=int, default=32_768, help="hpsray batch (unit of pull / write-back)")
    parser.add_argument("--ssd-batch", type=int, default=16_384, help="hpsray batch of the hpsray_ssd run")
    parser.add_argument(
        "--ssd-mem-fraction",
        type=float,
        default=0.25,
        help="hpsray_ssd MEM-PS budget as a share of the distinct keys trained (raised to hold "
        "the rows of two batches in flight when that is more)",
    )
    parser.add_argument("--shards", type=int, default=2, help="shard actors of the sharded_ps peer")
    parser.add_argument("--sparse-lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every trainer (default: all cores)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where hpsray's trainer, plain PyTorch and the MLP bound train (TorchRec and the "
        "sharded PS stay on the CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torchrec-venv",
        default=os.environ.get("HPSRAY_TORCHREC_VENV", str(DEFAULT_TORCHREC_VENV)),
        help="virtual environment with TorchRec (made by benchmarks/torchrec_env.sh)",
    )
    parser.add_argument(
        "--torchrec-optimizer",
        choices=("exact_adagrad", "rowwise_adagrad"),
        default="exact_adagrad",
        help="FBGEMM fused optimizer: exact_adagrad has the other systems' math; rowwise_adagrad "
        "keeps one accumulator per row",
    )
    parser.add_argument(
        "--ray-worker-niceness",
        type=int,
        default=0,
        help="niceness of the Ray actors of hpsray and sharded_ps (Ray's own default is 15, "
        "below the other peers' processes); -1 keeps Ray's default",
    )
    parser.add_argument(
        "--stage-niceness",
        type=int,
        default=None,
        help="hpsray's TrainerSettings.stage_niceness: its read, pull and load actors this many "
        "steps nicer than its trainer (default: the setting's default)",
    )
    parser.add_argument(
        "--stage-idle",
        action="store_true",
        help="hpsray's TrainerSettings.stage_idle: its read, pull and load actors under SCHED_IDLE",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one system may take")
    parser.add_argument(
        "--report-dir",
        default=None,
        help="write peers.json, peers.md (tables, hpsray stage tables), a throughput plot and "
        "each hpsray run's report (JSON + stage/cache/SSD PNGs) to this directory",
    )


# -- the orchestrator ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in str(args.keys_per_example).split(",") if s.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in RUNNABLE]
    if args.repeat < 1:
        raise SystemExit("hpsray bench peers: --repeat must be >= 1")
    if unknown or not systems:
        raise SystemExit(f"hpsray bench peers: unknown systems {unknown}; choose from {', '.join(RUNNABLE)}")
    scale = lambda n: max(int(n * args.size) // args.minibatch * args.minibatch, args.minibatch)  # noqa: E731
    base = PeerSpec(
        system="",
        data_dir="",
        n_slots=args.slots,
        keys_per_slot=args.keys,
        n_dense=args.dense,
        dim=args.dim,
        hidden=tuple(int(h) for h in args.hidden.split(",")),
        minibatch=args.minibatch,
        batch=args.batch,
        warmup_rows=scale(args.warmup_rows),
        rows=scale(args.rows),
        eval_rows=scale(args.eval_rows),
        sparse_lr=args.sparse_lr,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
        shards=args.shards,
        torchrec_optimizer=args.torchrec_optimizer,
        model=ModelSpec(args.model).to_dict() if args.model != "mlp" else {},
        extra={
            "ray_worker_niceness": None if args.ray_worker_niceness < 0 else args.ray_worker_niceness,
            "stage_niceness": args.stage_niceness,
            "stage_idle": args.stage_idle,
        },
    )
    base.train_config()  # validates
    out: dict = {"config": _config(base, args, systems), "by_keys_per_example": {}}
    reports: dict = {}
    tmp = tempfile.mkdtemp(prefix="hpsray-peers-")
    try:
        for kpe in sizes:
            spec = replace(base, keys_per_example=kpe, data_dir=os.path.join(tmp, f"data-{kpe}"))
            _log(f"{kpe} keys/example: generating {spec.warmup_rows + spec.rows:,} + {spec.eval_rows:,} examples")
            t0 = time.perf_counter()
            data = _prepare(spec, args)
            data["generate_s"] = time.perf_counter() - t0
            results = _run_size(spec, data, systems, args, tmp, reports)
            shutil.rmtree(spec.data_dir, ignore_errors=True)
            ceiling = {CEILING: results.pop(CEILING)} if CEILING in results else {}
            out["by_keys_per_example"][str(kpe)] = {
                "data": data,
                "systems": results,
                "ceiling": ceiling,
                "ratios": ratios(results, ceiling.get(CEILING)),
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.report_dir:
        out["report_files"] = write_peer_report(out, reports, args.report_dir)
    return out


def _run_size(
    spec: PeerSpec, data: dict, systems: list[str], args: argparse.Namespace, tmp: str, reports: dict
) -> dict:
    """Every system on one size, ``--repeat`` rounds round-robin (other load on the machine then
    hits every system alike); the fastest run of each system counts, all its rates are listed."""
    kpe = spec.keys_per_example
    results: dict = {}
    for round_ in range(args.repeat):
        for system in systems:
            _log(f"{kpe} keys/example: {system} ..." + (f" (round {round_ + 1})" if args.repeat > 1 else ""))
            r = _run_system(_spec_for(system, spec, data, tmp, args), args)
            _log(f"{kpe} keys/example: {system}: {_brief(r)}")
            rates = results.get(system, {}).get("examples_per_s_runs", [])
            if "examples_per_s" in r:
                rates = rates + [r["examples_per_s"]]
            best = results.get(system)
            if best is None or r.get("examples_per_s", -1) > best.get("examples_per_s", -1):
                results[system] = r
                reports[(kpe, system)] = r.pop("report", None)
            if rates:
                results[system]["examples_per_s_runs"] = rates
    return results


def _config(base: PeerSpec, args: argparse.Namespace, systems: list[str]) -> dict:
    cfg = base.train_config()
    return {
        "systems": systems,
        "slots": base.n_slots,
        "keys_per_slot": base.keys_per_slot,
        "table_rows": base.vocabulary_rows,
        "dense": base.n_dense,
        "dim": base.dim,
        "hidden": list(base.hidden),
        "model": {"kind": "mlp", "hidden": list(base.hidden)} if not base.model else base.model,
        "minibatch": base.minibatch,
        "batch": base.batch,
        "ssd_batch": args.ssd_batch,
        "warmup_rows": base.warmup_rows,
        "rows": base.rows,
        "eval_rows": base.eval_rows,
        "sparse_optimizer": cfg.sparse_optimizer,
        "sparse_lr": cfg.sparse_lr,
        "dense_optimizer": cfg.dense_optimizer,
        "dense_lr": cfg.dense_lr,
        "threads": base.threads,
        "cpus": os.cpu_count(),
        "seed": base.seed,
        "ray_worker_niceness": base.extra["ray_worker_niceness"],
        "stage_niceness": base.extra["stage_niceness"],
        "stage_idle": base.extra["stage_idle"],
        "ssd_mem_fraction": args.ssd_mem_fraction,
        "shards": base.shards,
        "torchrec_optimizer": base.torchrec_optimizer,
        "repeat": args.repeat,
    }


def _log(msg: str) -> None:
    print(f"[bench peers] {msg}", file=sys.stderr, flush=True)


def _brief(r: dict) -> str:
    if "examples_per_s" in r:
        auc = f", AUC {r['auc']:.4f}" if "auc" in r else ""
        return f"{r['examples_per_s']:,.0f} examples/s{auc}, peak RSS {r.get('peak_rss_bytes', 0) / 2**20:,.0f} MiB"
    return json.dumps(r)[:300]


def _prepare(spec: PeerSpec, args: argparse.Namespace) -> dict:
    """Generate and store the examples; also size hpsray_ssd's MEM-PS budget from them."""
    import numpy as np

    from hpsray.bench.baselines import load_examples, save_examples, split

    data = save_examples(spec)
    train = load_examples(spec, "train")
    most = max(np.unique(b.keys).size for b in split(train, args.ssd_batch))
    data["max_distinct_keys_per_ssd_batch"] = int(most)
    data["ssd_mem_capacity_rows"] = max(int(args.ssd_mem_fraction * data["distinct_train_keys"]), int(2.2 * most))
    return data


def _spec_for(system: str, spec: PeerSpec, data: dict, tmp: str, args: argparse.Namespace) -> PeerSpec:
    one = replace(spec, system=system, result_path=os.path.join(tmp, f"{system}-{spec.keys_per_example}.json"))
    if system == "hpsray_ssd":
        one = replace(one, batch=args.ssd_batch, mem_capacity_rows=int(data["ssd_mem_capacity_rows"]))
    return one


def _run_system(spec: PeerSpec, args: argparse.Namespace) -> dict:
    """Run one system in its own process; returns its figures, ``{"skipped": why}`` or ``{"error": ...}``."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each system starts its own local Ray
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    spec_path = f"{spec.result_path}.spec.json"
    Path(spec_path).write_text(spec.to_json())
    if spec.system == "torchrec":
        python = Path(args.torchrec_venv) / "bin" / "python"
        if not python.exists():
            return {
                "skipped": f"no TorchRec environment at {args.torchrec_venv}: run `bash benchmarks/torchrec_env.sh`"
            }
        if not TORCHREC_RUNNER.exists():
            return {"skipped": f"{TORCHREC_RUNNER} not found (hpsray installed without its benchmarks/ folder)"}
        cmd = [str(python), str(TORCHREC_RUNNER), spec_path]
    else:
        cmd = [sys.executable, "-m", "hpsray.bench.peer_process", spec_path]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the system's own process group (it may have started a Ray)
        output, _ = proc.communicate()
        return {"error": f"timed out after {args.timeout:.0f} s", "output_tail": output[-2000:]}
    assert spec.result_path is not None  # set by the caller (one file per system and size)
    if proc.returncode != 0 or not os.path.exists(spec.result_path):
        return {"error": f"exit status {proc.returncode}", "output_tail": (output or "")[-3000:]}
    with open(spec.result_path) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - t0
    # other load on the machine perturbs the figures: the 1-minute load average before and after
    result["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def ratios(results: dict, ceiling: dict | None = None) -> dict:
    """Throughput ratios of the hpsray runs to each peer, AUC differences, the issue's target,
    and (given the ``mlp_alone`` run) every system's rate over that bound."""
    out: dict = {}
    ok = {k: v for k, v in results.items() if isinstance(v, dict) and "examples_per_s" in v}
    if ceiling and "examples_per_s" in ceiling:
        out.update({f"{name}_vs_{CEILING}": r["examples_per_s"] / ceiling["examples_per_s"] for name, r in ok.items()})
    for mine in ("hpsray_in_memory", "hpsray_ssd"):
        if mine not in ok:
            continue
        for peer in ("pytorch", "torchrec", "sharded_ps"):
            if peer in ok:
                out[f"{mine}_vs_{peer}"] = ok[mine]["examples_per_s"] / ok[peer]["examples_per_s"]
                out[f"auc_{mine}_minus_{peer}"] = ok[mine]["auc"] - ok[peer]["auc"]
                out[f"rss_{mine}_vs_{peer}"] = ok[mine]["peak_rss_bytes"] / ok[peer]["peak_rss_bytes"]
    if "hpsray_ssd" in ok and "hpsray_in_memory" in ok:
        out["hpsray_ssd_vs_hpsray_in_memory"] = (
            ok["hpsray_ssd"]["examples_per_s"] / ok["hpsray_in_memory"]["examples_per_s"]
        )
    if "hpsray_in_memory_vs_pytorch" in out:
        out["target_met"] = bool(
            out["hpsray_in_memory_vs_pytorch"] >= 1.0
            and abs(out["auc_hpsray_in_memory_minus_pytorch"]) <= AUC_TOLERANCE
        )
    return out


# -- the report directory ----------------------------------------------------------------------


def write_peer_report(out: dict, reports: dict, directory: str) -> list[str]:
    """``peers.json``, ``peers.md`` (system table, ratios, hpsray stage tables), a throughput PNG,
    and each hpsray run's pipeline report (JSON + PNGs, :func:`hpsray.pipelines.report.write_report`)."""
    from hpsray.pipelines.report import format_stage_table, write_report

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    lines = ["# hpsray bench peers", "", "```", json.dumps(out["config"]), "```", ""]
    for kpe, run_ in out["by_keys_per_example"].items():
        lines += [
            f"## {kpe} keys per example",
            "",
            "| system | examples/s | AUC | peak RSS MiB | note |",
            "|---|---:|---:|---:|---|",
        ]
        for name, r in run_["systems"].items():
            if "examples_per_s" in r:
                lines.append(
                    f"| {name} | {r['examples_per_s']:,.0f} | {r['auc']:.4f} | {r['peak_rss_bytes'] / 2**20:,.0f} | |"
                )
            else:
                lines.append(f"| {name} | | | | {r.get('skipped') or r.get('error')} |")
        for name, r in run_.get("ceiling", {}).items():
            if "examples_per_s" in r:
                lines.append(
                    f"| {name} | {r['examples_per_s']:,.0f} | | {r['peak_rss_bytes'] / 2**20:,.0f} | "
                    "bound: the dense model's step alone |"
                )
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in run_["ratios"].items()]
        lines.append("")
        for (k, system), rep in sorted(reports.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if rep and str(k) == kpe:
                written += write_report(rep, d / f"{system}.{kpe}keys.json")
                lines += [
                    f"### {system}: pipeline stages",
                    "",
                    "```",
                    format_stage_table(rep),
                    "```",
                    f"plots: {system}.{kpe}keys.stage_times.png, .cache_hit_rate.png, .ssd_io.png",
                    "",
                ]
    (d / "peers.md").write_text("\n".join(lines) + "\n")
    (d / "peers.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    written += [str(d / "peers.md"), str(d / "peers.json")]
    png = _plot_throughput(out, d / "peers.examples_per_s.png")
    return [str(p) for p in written] + ([png] if png else [])


def _plot_throughput(out: dict, path: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    runs = out["by_keys_per_example"]
    systems = out["config"]["systems"]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        xs, ys = [], []
        for j, r in enumerate(runs.values()):
            v = (r["systems"].get(system) or r.get("ceiling", {}).get(system) or {}).get("examples_per_s")
            if v:
                xs.append(j + i * width)
                ys.append(v)
        ax.bar(xs, ys, width=width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))], [f"{k} keys/example" for k in runs])
    ax.set_ylabel("examples/s")
    ax.set_title("training throughput, same model and data")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return str(path)
