"""The trainer's step alone against plain PyTorch's, same mini-batches, same process (a profile).

    python benchmarks/profile_device_step.py --device cpu --keys-per-example 26[,100] [--model KIND]
        [--json] [--out F] [--graph] [--profile]

hpsray: a :class:`~hpsray.training.engine.TrainerEngine` holding every row of the data in its
working set, timed over whole batches: the batch's find-once index plus its mini-batch steps
(torch ops on the arena); and the same steps with the layout made before the clock, as the
read stage makes it, and staged for the upload as the trainer's fetch-ahead thread stages it
(``hpsray_read_index_examples_per_s``: the trainer finds the distinct keys and gathers their
slots; ``hpsray_read_index_unstaged_examples_per_s``: staged inside the clock). Plain
PyTorch: ``nn.EmbeddingBag(sparse=True)`` + sparse Adagrad under the same seeded model
(``--model``: the MLP 512-256-128 by default, or a kind of the zoo with its default settings,
as ``hpsray bench peers --model``; :mod:`hpsray.bench.baselines.plain_torch`), its key-to-row
mapping done before the clock as any integer-encoded data set has it. Both alternate over ``--repeat``
rounds; the best round of each counts. ``--profile`` adds the engine's aten ops by self time
(on CUDA, with the kernels' device time).

``--graph`` (CUDA): also the step as CUDA graphs. A mini-batch's shapes are fixed once it is
indexed, so each mini-batch's step (``train_local`` of it alone) is captured once, after a
warm-up on a side stream, and the timed rounds replay the graphs in order: the step's device
work without launch gaps, beside the same step launched op by op (``hpsray_step_examples_per_s``,
the index left out of both). A step that cannot be captured (a host read inside it, say) is
reported with its error. Several ``--keys-per-example`` give ``{"by_keys": {k: figures}}``;
``--out`` writes the JSON to a file as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from hpsray.bench.baselines.plain_torch import IndexedBatch, PlainTorchTrainer
from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.models.kinds import ModelSpec
from hpsray.tiers.loans import Loan
from hpsray.training.engine import TrainerEngine
from hpsray.training.layout import index_positions


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


def _optimizers(obj: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers held by ``obj``'s attributes (directly or in a list)."""
    out = []
    for v in vars(obj).values():
        for o in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(o, torch.optim.Optimizer):
                out.append(o)
    return out


def graph_variant(engine: TrainerEngine, batches: list, repeat: int, sync: Callable[[], None]) -> dict:
    """Each mini-batch's step captured as a CUDA graph and replayed (see the module docstring)."""
    if engine.device.torch.type != "cuda":
        return {"skipped": "CUDA graphs need --device cuda"}
    try:
        singles = []
        for batch in batches:
            index = engine.index(batch)
            for mb in index.minibatches:
                singles.append(dataclasses.replace(index, minibatches=[mb], n_examples=mb.n_examples))
        for opt in _optimizers(engine.dense):  # optimizer steps inside a graph: state on the device
            for group in opt.param_groups:
                if "capturable" in group:
                    group["capturable"] = True
            for state in opt.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(engine.device.torch, torch.float32)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: scratch grown to its largest, handles made
            for one in singles:
                engine.train_local(one)
        torch.cuda.current_stream().wait_stream(side)
        sync()
        graphs: list[torch.cuda.CUDAGraph] = []
        for one in singles:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=graphs[0].pool() if graphs else None):
                engine.train_local(one)
            graphs.append(g)
        best = float("inf")
        for _ in range(repeat + 1):  # the first round warms the replays
            sync()
            t0 = time.perf_counter()
            for g in graphs:
                g.replay()
            sync()
            best = min(best, time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - reported: the step does not capture as it stands
        return {"captured": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    examples = sum(one.n_examples for one in singles)
    return {"captured": True, "graphs": len(graphs), "examples_per_s": examples / best}


def measure(args: argparse.Namespace, keys_per_example: int) -> tuple[dict, Callable[[], dict]]:
    """The figures at ``keys_per_example`` (see the module docstring), and the graph variant's
    measurement over the same engine and batches, to call later (:func:`graph_variant`)."""
    gen = PlantedCTR(
        n_slots=26,
        keys_per_slot=args.keys_per_slot,
        n_dense=13,
        seed=0,
        nnz_per_slot=PlantedCTR.spread_nnz(26, keys_per_example),
    )
    model = ModelSpec(args.model).to_dict() if args.model != "mlp" else {"kind": "mlp"}
    cfg = TrainConfig(
        dim=16,
        hidden=(512, 256, 128),
        minibatch_size=args.minibatch,
        model_kind=model["kind"],
        model_settings={k: v for k, v in model.items() if k != "kind"},
    )
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

    # the read stage's layout (index_stage "read", the default on nodes of >= 4 cores), made
    # before the clock as the read stage makes it off the trainer; the trainer then finds the
    # borrowed keys (here all three batches' keys: more than a batch's, so conservative) and gathers
    # their slots. The layout is staged for the upload before the clock too, as the trainer actor
    # stages it on the thread that fetches the batch ahead (``unstaged``: staged inside the clock)
    unstaged = [index_positions(b, args.minibatch, np.searchsorted(keys, b.keys), keys.size) for b in batches]
    staged = [engine.stage(layout) for layout in unstaged]

    def run_engine_read_index(layouts: list = staged) -> float:
        sync()
        t0, losses = time.perf_counter(), []
        for batch, layout in zip(batches, layouts, strict=True):
            losses.append(engine.close_batch(engine.train_local(engine.index(batch, layout))))
        sync()
        return time.perf_counter() - t0

    def run_plain() -> float:
        sync()
        t0 = time.perf_counter()
        plain.fit(plain_mbs)
        sync()
        return time.perf_counter() - t0

    run_engine(), run_engine_read_index(), run_engine_read_index(unstaged), run_plain()  # warm-up
    hp, pt, idx, rd, un = [], [], [], [], []
    for _ in range(args.repeat):
        wall, index_s = run_engine()
        hp.append(wall)
        idx.append(index_s)
        rd.append(run_engine_read_index())
        un.append(run_engine_read_index(unstaged))
        pt.append(run_plain())
    examples = sum(len(b) for b in batches)
    best = int(np.argmin(hp))
    out = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "keys_per_example": keys_per_example,
        "model": model,
        "minibatch": args.minibatch,
        "examples": examples,
        "hpsray_examples_per_s": examples / hp[best],
        "hpsray_index_share": idx[best] / hp[best],
        "hpsray_step_examples_per_s": examples / max(hp[best] - idx[best], 1e-9),
        "pytorch_examples_per_s": examples / min(pt),
        "ratio_vs_pytorch": min(pt) / hp[best],
        "hpsray_read_index_examples_per_s": examples / min(rd),
        "ratio_read_index_vs_pytorch": min(pt) / min(rd),
        "hpsray_read_index_unstaged_examples_per_s": examples / min(un),
        "threads": torch.get_num_threads(),
    }
    if not args.json:
        print(
            f"device {args.device}, {keys_per_example} keys/example: hpsray {out['hpsray_examples_per_s']:,.0f} "
            f"examples/s (find-once index {out['hpsray_index_share']:.0%} of it), plain PyTorch "
            f"{out['pytorch_examples_per_s']:,.0f}: {out['ratio_vs_pytorch']:.2f}x; with the read stage's layout "
            f"{out['hpsray_read_index_examples_per_s']:,.0f}: {out['ratio_read_index_vs_pytorch']:.2f}x"
        )
    if args.profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else []
        )
        with torch.profiler.profile(activities=acts) as prof:
            run_engine()
        key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))

    def graph() -> dict:
        g = graph_variant(engine, batches, args.repeat, sync)
        if g.get("captured"):
            g["vs_step"] = g["examples_per_s"] / out["hpsray_step_examples_per_s"]
        if not args.json:
            print(f"device {args.device}, {keys_per_example} keys/example, each mini-batch's step as a CUDA graph: {g}")
        return g

    return out, graph


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--keys-per-example", default="26", help="one count or several, comma-separated (26,100)")
    ap.add_argument("--keys-per-slot", type=int, default=100_000)
    ap.add_argument("--model", default="mlp", choices=("mlp", "dlrm", "dcn"), help="the dense model (default mlp)")
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--minibatches-per-batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--graph", action="store_true", help="also each mini-batch's step as a CUDA graph (CUDA)")
    ap.add_argument("--profile", action="store_true", help="print the engine's aten ops by self time")
    args = ap.parse_args(argv)
    counts = [int(k) for k in str(args.keys_per_example).split(",") if k.strip()]
    if not counts or min(counts) < 1:
        ap.error(f"--keys-per-example: positive counts, got {args.keys_per_example!r}")
    runs: dict[str, dict] = {}

    def result() -> dict:
        return runs[str(counts[0])] if len(counts) == 1 else {"by_keys": runs}

    def save() -> None:  # after every figure: a run cut short keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result(), f, indent=2)

    graphs = {}
    for k in counts:  # every plain figure first: a capture that fails cannot spoil them
        runs[str(k)], graphs[str(k)] = measure(args, k)
        save()
    if args.graph:
        for k, graph in graphs.items():
            runs[k]["graph"] = graph()
            save()
    if args.json:
        print(json.dumps(result(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
