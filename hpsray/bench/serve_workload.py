"""The workload of ``hpsray bench serve``: the systems it compares, the synthetic model they
serve and the request bodies its clients send."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpsray.data import PlantedCTR
    from hpsray.serving import LoadOptions


SYSTEMS = ("tiered", "memory", "rocksdb", "bound", "driven", "tiered-mmap", "tiered-blocks")
DEFAULT_SYSTEMS = {"cpu": "tiered,memory,rocksdb,bound", "cuda": "tiered,driven,rocksdb,bound"}
BACKEND = {
    "tiered": "hpsray",
    "memory": "hpsray",
    "rocksdb": "rocksdb",
    "bound": "embedding-bag",
    "driven": "hpsray",
    "tiered-mmap": "hpsray",
    "tiered-blocks": "hpsray",
}
SSD_READ = {"tiered-mmap": "mmap", "tiered-blocks": "blocks"}
GPU_SYSTEMS = ("tiered", "memory", "driven")  # on --device cuda these run on the GPU; the baselines on the CPU


def make_model(
    directory: str,
    rows: int,
    dim: int = 16,
    n_slots: int = 26,
    n_dense: int = 13,
    hidden: tuple[int, ...] = (256, 128),
    seed: int = 0,
) -> PlantedCTR:
    """Export a synthetic model of ``rows`` rows (every rank of every slot) into ``directory``;
    returns the planted generator whose raw values address it."""
    import torch

    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.data.generate import dataset_schema
    from hpsray.data.keys import hash_keys
    from hpsray.export import export
    from hpsray.models import DNN

    per_slot = max(1, rows // n_slots)
    gen = PlantedCTR(n_slots=n_slots, keys_per_slot=per_slot, n_dense=n_dense, seed=seed)
    slots = np.repeat(np.arange(n_slots, dtype=np.int64), per_slot)
    ranks = np.tile(np.arange(per_slot, dtype=np.uint64), n_slots)
    keys = hash_keys(slots, ranks)
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((keys.size, dim)) * 0.05).astype(np.float32)
    config = TrainConfig(dim=dim, hidden=hidden, sparse_optimizer="sgd", seed=seed)
    dense = DNN(n_slots, dim, n_dense, hidden, seed=seed).state_dict()
    with torch.no_grad():
        export(
            (keys, weights, dense),
            directory,
            config,
            n_slots=n_slots,
            n_dense=n_dense,
            schema=dataset_schema(gen, "parquet"),
            extra={"trainer": "bench-serve"},
        )
    return gen


def request_bodies(gen: PlantedCTR, batch_size: int, n: int, start_block: int = 10_000) -> list[bytes]:
    """``n`` JSON bodies of ``batch_size`` raw examples each (Zipf values, as clients would send)."""
    from hpsray.data.generate import _table

    out: list[bytes] = []
    block = start_block
    pending: list[dict] = []
    while len(out) < n:
        batch, ranks = gen.raw_block(block)
        block += 1
        pending += _table(gen, batch, ranks, "parquet").drop(["label"]).to_pylist()
        while len(pending) >= batch_size and len(out) < n:
            out.append(json.dumps({"examples": pending[:batch_size]}).encode())
            pending = pending[batch_size:]
    return out


def load_options(
    system: str, mem_fraction: float, device: str = "cpu", device_fraction: float = 0.01, rows: int = 0
) -> LoadOptions:
    """The :class:`~hpsray.serving.LoadOptions` of one system of the bench."""
    from hpsray.serving import LoadOptions

    frac = mem_fraction if system in ("tiered", "rocksdb", "driven", *SSD_READ) else None
    on_gpu = device == "cuda" and system in GPU_SYSTEMS
    driver = "device" if system == "driven" else "cpu"
    device_rows = None
    if on_gpu or driver == "device":
        device_rows = int(np.ceil(device_fraction * rows)) if system != "memory" else None
        if frac is not None:  # 5 % in memory in all: the device tier's share comes out of the host tier's
            frac = max(0.0, frac - device_fraction)
    return LoadOptions(
        mem_fraction=frac,
        backend=BACKEND[system],
        device=device if on_gpu else "cpu",
        driver=driver,
        device_rows=device_rows,
        ssd_read=SSD_READ.get(system, "auto"),
    )
