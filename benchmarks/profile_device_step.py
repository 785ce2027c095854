"""The trainer's step alone against plain PyTorch's, same mini-batches, same process (a profile).

    python benchmarks/profile_device_step.py --device cpu --keys-per-example 26 [--json] [--profile]

hpsray: a :class:`~hpsray.training.engine.TrainerEngine` holding every row of the data in its
working set, timed over whole batches: the batch's find-once index plus its mini-batch steps
(torch ops on the arena). Plain PyTorch: ``nn.EmbeddingBag(sparse=True)`` + sparse Adagrad
under the same seeded DNN (:mod:`hpsray.bench.baselines.plain_torch`), its key-to-row mapping
done before the clock as any integer-encoded data set has it. Both alternate over ``--repeat``
rounds; the best round of each counts. ``--profile`` adds the engine's aten ops by self time
(on CUDA, with the kernels' device time).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from hpsray.bench.baselines.plain_torch import IndexedBatch, PlainTorchTrainer
from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine


def _plain_minibatches(batches, minibatch: int, keys: np.ndarray, device: torch.device) -> list[IndexedBatch]:
    out = []
    for batch in batches:
        for mb in batch.minibatches(minibatch):
            bag = mb.bag_index()
            n_bags = len(mb) * mb.n_slots
            offsets = np.zeros(n_bags, np.int64)
            np.cumsum(np.bincount(bag, minlength=n_bags)[:-1], out=offsets[1:])
            out.append(
                IndexedBatch(
                    torch.from_numpy(np.searchsorted(keys, mb.keys)),
                    torch.from_numpy(offsets),
                    torch.from_numpy(np.array(mb.dense)),
                    torch.from_numpy(np.array(mb.labels)),
                ).to(device)
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--keys-per-example", type=int, default=26)
    ap.add_argument("--keys-per-slot", type=int, default=100_000)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--minibatches-per-batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--profile", action="store_true", help="print the engine's aten ops by self time")
    args = ap.parse_args()
    gen = PlantedCTR(
        n_slots=26,
        keys_per_slot=args.keys_per_slot,
        n_dense=13,
        seed=0,
        nnz_per_slot=PlantedCTR.spread_nnz(26, args.keys_per_example),
    )
    cfg = TrainConfig(dim=16, hidden=(512, 256, 128), minibatch_size=args.minibatch)
    batches = [gen.generate(args.minibatch * args.minibatches_per_batch) for _ in range(args.batches)]
    keys = np.unique(np.concatenate([b.keys for b in batches]))
    rows = initial_rows(keys, cfg.row_width, cfg.row_init())
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    engine = TrainerEngine(cfg, 26, 13, capacity=keys.size + 1024, device=args.device)
    engine.borrow(0, [keys], [Loan(rows)])
    plain = PlainTorchTrainer(rows[:, : cfg.dim].copy(), 26, 13, cfg, args.device)
    plain_mbs = _plain_minibatches(batches, args.minibatch, keys, device)

    def run_engine() -> tuple[float, float]:
        sync()
        t0, index_s, losses = time.perf_counter(), 0.0, []
        for batch in batches:
            t = time.perf_counter()
            index = engine.index(batch)
            index_s += time.perf_counter() - t
            losses.append(engine.close_batch(engine.train_local(index)))
        sync()
        return time.perf_counter() - t0, index_s

    def run_plain() -> float:
        sync()
        t0 = time.perf_counter()
        plain.fit(plain_mbs)
        sync()
        return time.perf_counter() - t0

    run_engine(), run_plain()  # warm-up: allocations, first-call dispatch
    hp, pt, idx = [], [], []
    for _ in range(args.repeat):
        wall, index_s = run_engine()
        hp.append(wall)
        idx.append(index_s)
        pt.append(run_plain())
    examples = sum(len(b) for b in batches)
    best = int(np.argmin(hp))
    out = {
        "device": args.device,
        "keys_per_example": args.keys_per_example,
        "minibatch": args.minibatch,
        "examples": examples,
        "hpsray_examples_per_s": examples / hp[best],
        "hpsray_index_share": idx[best] / hp[best],
        "pytorch_examples_per_s": examples / min(pt),
        "ratio_vs_pytorch": min(pt) / hp[best],
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"device {args.device}, {args.keys_per_example} keys/example: hpsray {out['hpsray_examples_per_s']:,.0f} "
            f"examples/s (find-once index {out['hpsray_index_share']:.0%} of it), plain PyTorch "
            f"{out['pytorch_examples_per_s']:,.0f}: {out['ratio_vs_pytorch']:.2f}x"
        )
    if args.profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else []
        )
        with torch.profiler.profile(activities=acts) as prof:
            run_engine()
        key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))


if __name__ == "__main__":
    main()
