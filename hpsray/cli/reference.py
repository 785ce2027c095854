"""``hpsray reference``: train the in-memory reference trainer on planted synthetic data.

It is the oracle every configuration of hpsray must reproduce; this command shows what it
learns (AUC and log-loss on held-out rows beside the planted model's own AUC) and how fast.
"""

from __future__ import annotations

import argparse
import json
import time

HELP = "train the in-memory reference trainer (the oracle) on planted synthetic data and report AUC"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hpsray.config import SPARSE_OPTIMIZERS

    parser.add_argument("--rows", type=int, default=200_000, help="training examples (default 200k)")
    parser.add_argument("--eval-rows", type=int, default=50_000, help="held-out examples (default 50k)")
    parser.add_argument("--slots", type=int, default=26, help="categorical slots per example")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct keys per slot")
    parser.add_argument("--nnz", type=int, default=1, help="keys per slot per example")
    parser.add_argument("--dense", type=int, default=13, help="dense features per example")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--hidden", default="512,256,128", help="MLP widths")
    parser.add_argument("--batch", type=int, default=50_000, help="examples per batch")
    parser.add_argument("--minibatch", type=int, default=1024, help="examples per gradient step")
    parser.add_argument("--optimizer", default="adagrad", choices=SPARSE_OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=0.05, help="sparse learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.models import auc
    from hpsray.reference import ReferenceTrainer

    hidden = tuple(int(h) for h in args.hidden.split(",") if h.strip())
    config = TrainConfig(
        dim=args.dim,
        hidden=hidden,
        sparse_optimizer=args.optimizer,
        sparse_lr=args.lr,
        minibatch_size=args.minibatch,
        seed=args.seed,
    )
    data = PlantedCTR(
        n_slots=args.slots, keys_per_slot=args.keys, nnz_per_slot=args.nnz, n_dense=args.dense, seed=args.seed
    )
    trainer = ReferenceTrainer(args.slots, args.dense, config)
    started = time.perf_counter()
    quiet = args.json

    def progress(i, batch, loss):
        if not quiet:
            rate = trainer.examples / max(trainer.train_seconds, 1e-9)
            print(
                f"\rbatch {i + 1}: {trainer.examples:,}/{args.rows:,} examples  loss {loss:.4f}  "
                f"{rate:,.0f} examples/s  rows {len(trainer.store):,}",
                end="",
                flush=True,
            )

    trainer.fit(data.batches(args.rows, args.batch), progress=progress)
    if not quiet:
        print()
    held_out = data.generate(args.eval_rows, start_row=10**9)  # rows never trained on
    result = trainer.evaluate([held_out])
    report = {
        "auc": result.auc,
        "logloss": result.logloss,
        "planted_auc": auc(held_out.labels, data.true_logits(held_out)),
        "examples": trainer.examples,
        "examples_per_s": trainer.examples / max(trainer.train_seconds, 1e-9),
        "rows": len(trainer.store),
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"held-out AUC {report['auc']:.4f} (planted model {report['planted_auc']:.4f}), "
            f"log-loss {report['logloss']:.4f}, {report['examples_per_s']:,.0f} examples/s, "
            f"{report['rows']:,} rows learnt"
        )
    return 0
