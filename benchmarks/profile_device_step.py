"""Where a trainer's mini-batch step spends its time, on the CPU or a GPU (a profile, not a benchmark).

    python benchmarks/profile_device_step.py --device cuda --keys-per-example 26

Runs the step exactly as a one-node :class:`~hpsray.actors.trainer.Trainer` does (HBM-PS rows,
:class:`~hpsray.models.step.DenseReplicas` on the device, the sparse update in the tables) over
generated mini-batches, after a warm-up, under cProfile; prints examples/s and the functions
with the most time of their own. On CUDA a call that waits for the device (a read-back) carries
the queued kernels' time, so the profile names the synchronisation points too.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.models.device import StepDevice
from hpsray.models.dnn import DNN
from hpsray.models.step import DenseReplicas
from hpsray.tiers.hbm import HbmPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--keys-per-example", type=int, default=26)
    ap.add_argument("--minibatches", type=int, default=40)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    gen = PlantedCTR(
        n_slots=26,
        keys_per_slot=100_000,
        n_dense=13,
        seed=0,
        nnz_per_slot=PlantedCTR.spread_nnz(26, args.keys_per_example),
    )
    cfg = TrainConfig(dim=16, hidden=(512, 256, 128), minibatch_size=args.minibatch)
    batch = gen.generate(args.minibatch * (args.minibatches + 5))
    dev = StepDevice(args.device)
    keys = np.unique(batch.keys)
    hbm = HbmPS(keys.size + 1024, cfg.row_width, cfg.row_init(), device=args.device)
    hbm.insert(keys, initial_rows(keys, cfg.row_width, cfg.row_init()))
    dense = DenseReplicas(DNN(26, cfg.dim, 13, cfg.hidden, seed=0), 1, cfg.dense_optimizer, cfg.dense_lr, dev)
    opt = cfg.optimizer()
    mbs = list(batch.minibatches(args.minibatch))

    def run(part) -> torch.Tensor:
        losses = []
        for step, mb in enumerate(part, 1):
            loss, gkeys, grads = dense.step(mb, lambda k: hbm.get(k, columns=cfg.dim))
            hbm.apply_gradients(gkeys, grads, opt, step)
            losses.append(loss)
        return torch.stack(losses).sum()

    float(run(mbs[:5]))  # warm-up: compiles the kernels
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    float(run(mbs[5:]))
    prof.disable()
    wall = time.perf_counter() - t0
    examples = sum(len(mb) for mb in mbs[5:])
    print(
        f"device {args.device}, {args.keys_per_example} keys/example: {examples / wall:,.0f} examples/s "
        f"({wall / len(mbs[5:]) * 1e3:.2f} ms per mini-batch of {args.minibatch})"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
