"""The one-node step with the fused sparse update against the same step unfused, same process.

    python benchmarks/fused_step.py [--device cpu] [--keys-per-example 26,100] [--minibatch 4096]
        [--optimizer adagrad] [--repeat 3] [--json]

Two :class:`~hpsray.training.engine.TrainerEngine` s hold every row of the same data; one steps
with ``hpsray::fused_sparse_update`` (``ArenaStep.fused``), the other with the unfused ops
(``embedding_bag`` of the pooled gradient, the optimizer's element-wise ops, ``index_copy_``).
Both train the same indexed mini-batches (the index made before the clock), alternating over
``--repeat`` rounds; the best round of each counts: ms per mini-batch of the whole step (dense
model included) and ``unfused / fused``; and the sparse update alone (``ArenaStep.apply`` of
each mini-batch for a fixed pooled gradient), likewise. Both end with the same rows, bit for
bit (checked).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.step import ArenaStep


def measure(args: argparse.Namespace, keys_per_example: int) -> dict:
    gen = PlantedCTR(
        n_slots=26,
        keys_per_slot=args.keys_per_slot,
        n_dense=13,
        seed=0,
        nnz_per_slot=PlantedCTR.spread_nnz(26, keys_per_example),
    )
    cfg = TrainConfig(dim=16, hidden=(512, 256, 128), minibatch_size=args.minibatch, sparse_optimizer=args.optimizer)
    batches = [gen.generate(args.minibatch * args.minibatches_per_batch) for _ in range(args.batches)]
    keys = np.unique(np.concatenate([b.keys for b in batches]))
    rows = initial_rows(keys, cfg.row_width, cfg.row_init())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    engines = {}
    for fused in (True, False):
        engine = TrainerEngine(cfg, 26, 13, capacity=keys.size + 1024, device=args.device)
        engine.borrow(0, [keys], [Loan(rows.copy())])
        engine.arena.fused = fused
        engines[fused] = (engine, [engine.index(b) for b in batches])

    def run(fused: bool) -> float:
        engine, indexes = engines[fused]
        sync()
        t0 = time.perf_counter()
        for index in indexes:
            engine.close_batch(engine.train_local(index))
        sync()
        return time.perf_counter() - t0

    pooled = {}  # per engine, each mini-batch's pooled leaf with a fixed gradient
    for fused, (engine, indexes) in engines.items():
        rng = torch.Generator().manual_seed(1)
        pooled[fused] = []
        for index in indexes:
            for mb in index.minibatches:
                leaf = ArenaStep.pool_rows(engine.arena.gather(mb.rows), mb, cfg.dim).detach().requires_grad_(True)
                leaf.grad = (1e-3 * torch.randn(leaf.shape, generator=rng)).to(leaf.device)
                pooled[fused].append((mb, leaf))

    def update(fused: bool) -> float:
        engine = engines[fused][0]
        arena = engine.arena
        sync()
        t0 = time.perf_counter()
        for mb, leaf in pooled[fused]:
            arena.apply(mb, arena.gather(mb.rows), leaf, engine.step + 1)
        sync()
        return time.perf_counter() - t0

    run(True), run(False), update(True), update(False)  # warm-up: allocations, first calls
    walls: dict[bool, list[float]] = {True: [], False: []}
    updates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for fused in (True, False):
            walls[fused].append(run(fused))
            updates[fused].append(update(fused))
    same = bool(np.array_equal(engines[True][0].rows(keys), engines[False][0].rows(keys)))
    n_mb = sum(len(ix.minibatches) for _, ixs in engines.values() for ix in ixs) // 2
    fused_ms, unfused_ms = 1e3 * min(walls[True]) / n_mb, 1e3 * min(walls[False]) / n_mb
    fused_up, unfused_up = 1e3 * min(updates[True]) / n_mb, 1e3 * min(updates[False]) / n_mb
    return {
        "keys_per_example": keys_per_example,
        "minibatch": args.minibatch,
        "optimizer": args.optimizer,
        "minibatches": n_mb,
        "fused_ms_per_minibatch": fused_ms,
        "unfused_ms_per_minibatch": unfused_ms,
        "unfused_over_fused": unfused_ms / fused_ms,
        "update_fused_ms": fused_up,
        "update_unfused_ms": unfused_up,
        "update_unfused_over_fused": unfused_up / fused_up,
        "same_rows": same,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--keys-per-example", default="26,100")
    ap.add_argument("--keys-per-slot", type=int, default=100_000)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--minibatches-per-batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "adagrad_row", "adam"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = []
    for k in (int(x) for x in args.keys_per_example.split(",")):
        r = measure(args, k)
        out.append(r)
        if not args.json:
            print(
                f"{args.device}, {k} keys/example, {args.optimizer}: fused {r['fused_ms_per_minibatch']:.1f} ms, "
                f"unfused {r['unfused_ms_per_minibatch']:.1f} ms per mini-batch of {args.minibatch}: "
                f"{r['unfused_over_fused']:.2f}x; the sparse update alone {r['update_fused_ms']:.2f} vs "
                f"{r['update_unfused_ms']:.2f} ms: {r['update_unfused_over_fused']:.2f}x (same rows: {r['same_rows']})"
            )
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
