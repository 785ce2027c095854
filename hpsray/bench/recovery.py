"""``hpsray bench recovery``: what checkpoints cost and how long a recovery takes.

Same planted data, model and tiers (a MEM-PS budget that sends rows to SSD-PS) in one run:

- the pipeline without checkpoints (the baseline) and with a checkpoint every ``--every``
  batches (the default interval), alternating ``--repeat`` times: ``checkpoint_share`` is the
  checkpoints' seconds over the training wall time, ``wall_ratio`` the wall time with
  checkpoints over the baseline's (medians);
- one more run with checkpoints in which the trainer's process is killed (SIGKILL) after
  ``--kill-after`` batches: ``restart_s`` is the time from the failure reaching the driver to
  the restarted stages (training again), ``replayed_batches`` the batches trained since the
  checkpoint, trained again, and ``replay_s`` their time at the baseline's pace.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpsray.pipelines import Pipeline

HELP = "checkpoint cost (share of training time) and time from a killed actor to training again"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=400_000, help="training examples per run")
    parser.add_argument("--batch", type=int, default=4096, help="examples per batch")
    parser.add_argument("--minibatch", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--keys", type=int, default=20_000, help="distinct keys per slot")
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", default="256,128")
    parser.add_argument("--mem-fraction", type=float, default=0.25, help="MEM-PS rows as a share of all rows")
    parser.add_argument("--every", type=int, default=None, help="batches between checkpoints (default: the default)")
    parser.add_argument("--kill-after", type=int, default=None, help="batches before the kill (default: 60%% of them)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)


def _kill_trainer_after(pipeline: Pipeline, batches: int, done: threading.Event) -> None:
    """SIGKILL node 0's trainer once it has trained ``batches`` batches of this pass."""
    import ray

    while not done.is_set():
        nodes = pipeline._nodes
        if nodes and nodes[0].reader is not None:
            try:
                stats = ray.get(nodes[0].trainer.__ray_call__.remote(lambda t: (len(t.losses), os.getpid())), timeout=5)
            except Exception:  # noqa: BLE001,S112 - busy or starting: ask again
                continue
            if stats[0] >= batches:
                os.kill(stats[1], signal.SIGKILL)
                return
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.cluster.runtime import connect
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import (
        CheckpointSettings,
        MemPSSettings,
        Pipeline,
        SSDPSSettings,
        SyntheticSource,
        TrainerSettings,
    )

    every = args.every or CheckpointSettings.every_batches
    hidden = tuple(int(h) for h in args.hidden.split(","))
    cfg = TrainConfig(dim=args.dim, hidden=hidden, minibatch_size=args.minibatch, seed=args.seed)
    gen = PlantedCTR(n_slots=args.slots, keys_per_slot=args.keys, n_dense=args.dense, seed=args.seed)
    source = SyntheticSource(gen, rows=args.rows)
    n_batches = -(-args.rows // args.batch)
    kill_after = args.kill_after or max(1, int(0.6 * n_batches))
    mem_rows = max(int(args.mem_fraction * args.slots * args.keys), 4 * args.batch * args.slots)
    work = tempfile.mkdtemp(prefix="hpsray-bench-recovery-")
    started = connect(include_dashboard=False, log_to_driver=False)

    def pipeline(tag: str, checkpoint: bool) -> Pipeline:
        stage = CheckpointSettings(f"{work}/{tag}/ckpt", every_batches=every) if checkpoint else None
        return Pipeline(
            source,
            TrainerSettings(cfg),
            MemPSSettings(capacity_rows=mem_rows),
            SSDPSSettings(f"{work}/{tag}/ssd"),
            batch_size=args.batch,
            checkpoint=stage,
        )

    runs, kill = [], {}
    try:
        for r in range(max(1, args.repeat)):
            row = {}
            for tag, checkpoint in (("baseline", False), ("checkpoints", True)):
                shutil.rmtree(f"{work}/{tag}", ignore_errors=True)
                with pipeline(tag, checkpoint) as p:
                    report = p.fit(progress=False)
                row[f"{tag}_wall_s"] = report["wall_s"]
                if checkpoint:
                    row["checkpoint_s"] = report["checkpoints"]["seconds"]
                    row["checkpoints"] = report["checkpoints"]["count"]
                    row["checkpoint_bytes"] = report["checkpoints"]["bytes"]
            row["wall_ratio"] = row["checkpoints_wall_s"] / row["baseline_wall_s"]
            row["checkpoint_share"] = row["checkpoint_s"] / row["checkpoints_wall_s"]
            runs.append(row)
            print(
                f"[bench recovery] repeat {r + 1}: wall with checkpoints / without {row['wall_ratio']:.3f}, "
                f"checkpoints {row['checkpoint_share']:.1%} of the wall time",
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(f"{work}/kill", ignore_errors=True)
        with pipeline("kill", True) as p:
            p._start()
            done = threading.Event()
            killer = threading.Thread(target=_kill_trainer_after, args=(p, kill_after, done), daemon=True)
            killer.start()
            report = p.fit(progress=False)
            done.set()
            seconds_per_batch = float(np.median([r["baseline_wall_s"] for r in runs])) / n_batches
            rec = report["recovery"][0] if report["recovery"] else {}
            kill = {
                "killed_after_batches": kill_after,
                "recoveries": len(report["recovery"]),
                "restart_s": rec.get("restart_s"),
                "replayed_batches": rec.get("replayed_batches"),
                "replay_s": (rec.get("replayed_batches") or 0) * seconds_per_batch,  # at the baseline's pace
                "restarted": rec.get("restarted"),
                "reset": rec.get("reset"),
                "wall_s": report["wall_s"],
            }
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def median(key: str) -> float:
        return float(np.median([run[key] for run in runs]))

    return {
        "every_batches": every,
        "batches": n_batches,
        "checkpoint_share": median("checkpoint_share"),
        "wall_ratio": median("wall_ratio"),
        "checkpoint_mean_s": median("checkpoint_s") / max(median("checkpoints"), 1),
        "baseline_wall_s": median("baseline_wall_s"),
        "checkpoints_wall_s": median("checkpoints_wall_s"),
        "kill": kill,
        "runs": runs,
        "rows": args.rows,
        "batch": args.batch,
        "mem_rows": mem_rows,
        "all_rows": args.slots * args.keys,
    }
