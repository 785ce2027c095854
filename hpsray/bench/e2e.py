"""``hpsray bench e2e``: the Ray pipeline against the in-memory reference trainer.

Same data, model, optimizers and batches, warmed up, then timed ``--repeat`` times with the two
alternating; medians in ``examples_per_s``, ``reference_examples_per_s``, ``ratio_vs_reference``
and ``pipeline_efficiency``. Two more pairs in the same way: small batches
(``small_batch_*``) and, with ``--spill``, a MEM-PS budget below the rows trained (``spill_*``).
The cases, keys and targets: docs/benchmarks.md, section "What each bench measures" (`bench e2e`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import Pipeline, SyntheticSource
    from hpsray.reference import ReferenceTrainer

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
    parser.add_argument("--devices", type=int, default=1, help="trainer processes per node (one per GPU on cuda)")
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
    parser.add_argument(
        "--small-batch-rows",
        type=int,
        default=100_000,
        help="measured examples of the small-batch case (0: skip it)",
    )
    parser.add_argument("--small-batch", type=int, default=10_000, help="examples per batch of the small-batch case")
    parser.add_argument("--small-batch-slots", type=int, default=5, help="slots of the small-batch case")
    parser.add_argument(
        "--spill",
        action="store_true",
        help="also run the job with a MEM-PS budget well below its rows (SSD-PS serves the misses) "
        "beside the same job all in memory",
    )
    parser.add_argument("--spill-batch", type=int, default=10_000, help="examples per batch of the spill case")
    parser.add_argument(
        "--spill-budget-batches",
        type=float,
        default=2.5,
        help="MEM-PS budget of the spill case, in units of a batch's distinct keys (> 2: two batches are pinned)",
    )


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.cluster.runtime import connect
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings
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
    try:
        with Pipeline(
            warmup,
            TrainerSettings(cfg, n_devices=args.devices, device=args.device, threads=args.trainer_threads),
            MemPSSettings(capacity_rows=all_rows + 1024),
            batch_size=args.batch,
        ) as p:
            p.fit(progress=False)
            p.source = measured
            runs = _alternate(p, ref, measured, args.batch, args.rows, args.repeat, "repeat")
        extra: dict = {}
        if args.small_batch_rows > 0:
            extra.update(_small_batch(args, cfg))
        if args.spill:
            extra.update(_spill(args, cfg, gen))
    finally:
        if started:
            ray.shutdown()

    def median(key: str) -> float:
        return _median(runs, key)

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
        **extra,
    }


def _median(runs: list[dict], key: str) -> float:
    return float(np.median([run[key] for run in runs]))


def _alternate(
    p: Pipeline, ref: ReferenceTrainer, measured: SyntheticSource, batch: int, rows: int, repeat: int, label: str
) -> list[dict]:
    """``repeat`` timed passes of the (warm) pipeline ``p`` over ``measured``, each after the same
    pass of the reference trainer ``ref``: one dict of figures per repeat."""
    runs = []
    for r in range(max(1, repeat)):
        t0 = time.perf_counter()
        ref.fit(measured.open(batch))
        ref_s = time.perf_counter() - t0
        report = p.fit(progress=False)
        runs.append(
            {
                "examples_per_s": report["examples_per_s"],
                "reference_examples_per_s": rows / ref_s,
                "ratio_vs_reference": report["examples_per_s"] * ref_s / rows,
                "pipeline_efficiency": report["pipeline_efficiency"],
                "wall_s": report["wall_s"],
                "reference_wall_s": ref_s,
                "stage_busy_s": report["stage_busy_s"],
            }
        )
        _log(
            f"{label} {r + 1}: pipeline {runs[-1]['examples_per_s']:,.0f} ex/s, "
            f"reference {runs[-1]['reference_examples_per_s']:,.0f} ex/s, "
            f"ratio {runs[-1]['ratio_vs_reference']:.3f}"
        )
    return runs


def _log(msg: str) -> None:
    print(f"[bench e2e] {msg}", file=sys.stderr, flush=True)


def _small_batch(args: argparse.Namespace, cfg: TrainConfig) -> dict:
    """The pipeline against the reference on a job of few slots in small batches."""
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings
    from hpsray.reference import ReferenceTrainer

    slots, batch = args.small_batch_slots, args.small_batch
    gen = PlantedCTR(n_slots=slots, keys_per_slot=args.keys, n_dense=args.dense, seed=args.seed)
    warmup_rows = max(args.warmup_rows // 4, 2 * batch)
    warmup = SyntheticSource(gen, rows=warmup_rows)
    measured = SyntheticSource(gen, rows=args.small_batch_rows, start_row=warmup_rows)
    _log(f"small batches ({slots} slots, batches of {batch:,}): warming up ...")
    ref = ReferenceTrainer(slots, args.dense, cfg)
    ref.fit(warmup.open(batch))
    with Pipeline(
        warmup,
        TrainerSettings(cfg, n_devices=args.devices, device=args.device, threads=args.trainer_threads),
        MemPSSettings(capacity_rows=slots * args.keys + 1024),
        batch_size=batch,
    ) as p:
        p.fit(progress=False)
        p.source = measured
        runs = _alternate(p, ref, measured, batch, args.small_batch_rows, args.repeat, "small batches, repeat")
    return {
        "small_batch_examples_per_s": _median(runs, "examples_per_s"),
        "small_batch_reference_examples_per_s": _median(runs, "reference_examples_per_s"),
        "small_batch_ratio_vs_reference": _median(runs, "ratio_vs_reference"),
        "small_batch_pipeline_efficiency": _median(runs, "pipeline_efficiency"),
        "small_batch": {"rows": args.small_batch_rows, "batch": batch, "slots": slots},
        "small_batch_runs": runs,
    }


def _max_distinct(source: SyntheticSource, batch: int, n: int) -> int:
    """Most distinct keys in one of the first ``n`` batches of ``source``."""
    from hpsray.kernels.distinct import distinct_sorted

    most = 0
    for i, b in enumerate(source.open(batch)):
        most = max(most, int(distinct_sorted(b.keys).size))
        if i + 1 >= n:
            break
    return most


def _rows_trained(gen: PlantedCTR, rows: int) -> int:
    """Distinct keys of the first ``rows`` examples: the rows the job trains."""
    from hpsray.kernels.distinct import distinct_sorted

    seen = np.empty(0, dtype=np.uint64)
    for start in range(0, rows, 100_000):
        keys = gen.generate(min(100_000, rows - start), start_row=start).keys
        seen = distinct_sorted(np.concatenate([seen, keys]))
    return int(seen.size)


def _spill(args: argparse.Namespace, cfg: TrainConfig, gen: PlantedCTR) -> dict:
    """The job with a MEM-PS budget well below its rows beside the same job all in memory."""
    import math
    import tempfile

    from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, SyntheticSource, TrainerSettings

    batch = args.spill_batch
    warmup = SyntheticSource(gen, rows=args.warmup_rows)
    measured = SyntheticSource(gen, rows=args.rows, start_row=args.warmup_rows)
    per_batch = _max_distinct(measured, batch, 8)
    budget = int(math.ceil(args.spill_budget_batches * per_batch * 1.05))
    all_rows = args.slots * args.keys
    _log(f"spill: MEM-PS budget {budget:,} rows ({args.spill_budget_batches} x {per_batch:,}), batches of {batch:,}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="hpsray-e2e-spill-") as base:

        def pipeline(capacity: int, ssd: str) -> Pipeline:
            return Pipeline(
                warmup,
                TrainerSettings(cfg, n_devices=args.devices, device=args.device, threads=args.trainer_threads),
                MemPSSettings(capacity_rows=capacity),
                SSDPSSettings(path=f"{base}/{ssd}"),
                batch_size=batch,
            )

        with pipeline(all_rows + 1024, "mem") as mem, pipeline(budget, "spill") as spill:
            for p in (mem, spill):
                p.fit(progress=False)
                p.source = measured
            for r in range(max(1, args.repeat)):
                in_memory = mem.fit(progress=False)
                spilled = spill.fit(progress=False)
                runs.append(
                    {
                        "spill_examples_per_s": spilled["examples_per_s"],
                        "in_memory_examples_per_s": in_memory["examples_per_s"],
                        "spill_vs_in_memory": spilled["examples_per_s"] / in_memory["examples_per_s"],
                        "spill_pipeline_efficiency": spilled["pipeline_efficiency"],
                        "in_memory_pipeline_efficiency": in_memory["pipeline_efficiency"],
                        "spill_stage_busy_s": spilled["stage_busy_s"],
                        "in_memory_stage_busy_s": in_memory["stage_busy_s"],
                        "spill_cache": spilled.get("cache", {}),
                        "spill_ssd": spilled.get("ssd", {}),
                    }
                )
                _log(
                    f"spill, repeat {r + 1}: spilled {runs[-1]['spill_examples_per_s']:,.0f} ex/s "
                    f"(efficiency {runs[-1]['spill_pipeline_efficiency']:.2f}), in memory "
                    f"{runs[-1]['in_memory_examples_per_s']:,.0f} ex/s, ratio {runs[-1]['spill_vs_in_memory']:.3f}"
                )
        model_rows = int(_rows_trained(gen, args.warmup_rows + args.rows))
    return {
        "spill_examples_per_s": _median(runs, "spill_examples_per_s"),
        "in_memory_examples_per_s": _median(runs, "in_memory_examples_per_s"),
        "spill_vs_in_memory": _median(runs, "spill_vs_in_memory"),
        "spill_pipeline_efficiency": _median(runs, "spill_pipeline_efficiency"),
        "spill_budget_rows": budget,
        "spill_max_distinct_keys_per_batch": per_batch,
        "spill_batch": batch,
        "spill_model_rows": model_rows,
        "spill_model_vs_budget": model_rows / budget,
        "spill_runs": runs,
    }
