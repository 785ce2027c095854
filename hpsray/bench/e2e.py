"""``hpsray bench e2e``: the Ray pipeline against the in-memory reference trainer.

Same planted data, same model and optimizers, same batches, in one run; every row fits in
MEM-PS. Both are warmed up on a few batches first (numba compilation, actor start-up), then
timed over the measured rows, ``--repeat`` times with the two alternating (a shared machine
then slows both alike). Reports medians: ``examples_per_s`` (pipeline),
``reference_examples_per_s``, ``ratio_vs_reference`` (median of the per-repeat ratios), and the
pipeline's stage busy times and ``pipeline_efficiency``; ``runs`` keeps every repeat.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

HELP = "end-to-end pipeline throughput vs the in-memory reference trainer (same data, model, run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=300_000, help="measured training examples")
    parser.add_argument("--warmup-rows", type=int, default=40_000, help="examples trained before timing")
    parser.add_argument("--batch", type=int, default=50_000, help="examples per batch")
    parser.add_argument("--minibatch", type=int, default=4096, help="examples per gradient step")
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--keys", type=int, default=20_000, help="distinct keys per slot")
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", default="512,256,128")
    parser.add_argument("--devices", type=int, default=1, help="virtual devices per trainer")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the trainer's step runs (the reference stays on the CPU)",
    )
    parser.add_argument(
        "--trainer-threads", type=int, default=None, help="torch threads of the pipeline's trainer (default: all cores)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="alternating reference / pipeline passes over the measured rows (medians reported)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.cluster.runtime import connect
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSStage, Pipeline, SyntheticSource, TrainerStage
    from hpsray.reference import ReferenceTrainer

    hidden = tuple(int(h) for h in args.hidden.split(","))
    cfg = TrainConfig(dim=args.dim, hidden=hidden, minibatch_size=args.minibatch, seed=args.seed)
    gen = PlantedCTR(n_slots=args.slots, keys_per_slot=args.keys, n_dense=args.dense, seed=args.seed)
    warmup = SyntheticSource(gen, rows=args.warmup_rows)
    measured = SyntheticSource(gen, rows=args.rows, start_row=args.warmup_rows)
    all_rows = args.slots * args.keys  # every row fits in MEM-PS

    print("[bench e2e] warming up ...", file=sys.stderr, flush=True)
    ref = ReferenceTrainer(args.slots, args.dense, cfg)
    ref.fit(warmup.open(args.batch))
    started = connect(include_dashboard=False, log_to_driver=False)
    runs = []
    try:
        with Pipeline(
            warmup,
            TrainerStage(cfg, n_devices=args.devices, device=args.device, threads=args.trainer_threads),
            MemPSStage(capacity_rows=all_rows + 1024),
            batch_size=args.batch,
        ) as p:
            p.fit(progress=False)
            p.source = measured
            for r in range(max(1, args.repeat)):
                t0 = time.perf_counter()
                ref.fit(measured.open(args.batch))
                ref_s = time.perf_counter() - t0
                report = p.fit(progress=False)
                runs.append(
                    {
                        "examples_per_s": report["examples_per_s"],
                        "reference_examples_per_s": args.rows / ref_s,
                        "ratio_vs_reference": report["examples_per_s"] * ref_s / args.rows,
                        "pipeline_efficiency": report["pipeline_efficiency"],
                        "wall_s": report["wall_s"],
                        "reference_wall_s": ref_s,
                        "stage_busy_s": report["stage_busy_s"],
                    }
                )
                print(
                    f"[bench e2e] repeat {r + 1}: pipeline {runs[-1]['examples_per_s']:,.0f} ex/s, "
                    f"reference {runs[-1]['reference_examples_per_s']:,.0f} ex/s, "
                    f"ratio {runs[-1]['ratio_vs_reference']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if started:
            ray.shutdown()

    def median(key: str) -> float:
        return float(np.median([run[key] for run in runs]))

    mid = runs[int(np.argsort([run["ratio_vs_reference"] for run in runs])[len(runs) // 2])]
    return {
        "examples_per_s": median("examples_per_s"),
        "reference_examples_per_s": median("reference_examples_per_s"),
        "ratio_vs_reference": median("ratio_vs_reference"),
        "pipeline_efficiency": median("pipeline_efficiency"),
        "stage_busy_s": mid["stage_busy_s"],  # of the repeat with the median ratio
        "wall_s": median("wall_s"),
        "reference_wall_s": median("reference_wall_s"),
        "runs": runs,
        "rows": args.rows,
        "batch": args.batch,
        "minibatch": args.minibatch,
        "slots": args.slots,
        "dim": args.dim,
        "hidden": list(hidden),
        "devices": args.devices,
        "device": args.device,
        "trainer_threads": args.trainer_threads,
    }
