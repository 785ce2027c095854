"""The phases of ``hpsray bench bigger-than-memory`` that run in child processes inside its
memory cgroup (``python -m hpsray.bench.bigger_than_memory_phases PHASE JSON``: the answer is the
last line of stdout), and the :class:`Job` every phase agrees on."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import Pipeline, SyntheticSource

TABLE_SEED = 77  # the "pretrained" table's values differ from the initialiser's (seed 0)
TABLE_STATE = 0.25  # and so does its optimizer state


def table_rows(keys: np.ndarray, dim: int, width: int) -> np.ndarray:
    """The imported table's row of each key: a deterministic function of the key (the seeded
    initialiser with another seed and state), so the reference needs no copy of the table."""
    from hpsray.kernels.init import RowInit, initial_rows

    return initial_rows(keys, width, RowInit(dim=dim, scale=0.05, seed=TABLE_SEED, state_value=TABLE_STATE))


@dataclass
class Job:
    """What every phase agrees on (passed to the children as JSON)."""

    dim: int
    width: int
    slots: int
    keys_per_slot: int
    dense: int
    zipf: float
    hidden: list[int]
    batch: int
    minibatch: int
    warmup_rows: int
    examples: int
    mem_rows: int
    object_store: int
    io_threads: int = 4

    def generator(self) -> PlantedCTR:
        from hpsray.data import PlantedCTR

        return PlantedCTR(
            n_slots=self.slots, keys_per_slot=self.keys_per_slot, n_dense=self.dense, zipf_a=self.zipf, seed=3
        )

    def config(self) -> TrainConfig:
        from hpsray.config import TrainConfig

        return TrainConfig(
            dim=self.dim,
            hidden=tuple(self.hidden),
            minibatch_size=self.minibatch,
            sparse_optimizer="adagrad",
            sparse_lr=0.05,
        )

    def sources(self) -> tuple[SyntheticSource, SyntheticSource]:
        """The warm-up source and the timed pass's source (consecutive rows of one stream)."""
        from hpsray.pipelines import SyntheticSource

        gen = self.generator()
        return SyntheticSource(gen, self.warmup_rows), SyntheticSource(gen, self.examples, start_row=self.warmup_rows)


def _phase_import(p: dict) -> dict:
    from hpsray.tiers.ssd import SSDPS, TableImport

    with SSDPS(p["store"], p["width"]) as store:
        done = store.bulk_load(TableImport(p["table"], p["dim"], TABLE_STATE))
        done["key_map_bytes"] = store.stats["key_map_bytes"]
    return done


def _pipeline(job: Job, ssd_path: str, mem_rows: int, sources: tuple[SyntheticSource, SyntheticSource]) -> Pipeline:
    import ray

    from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, TrainerSettings

    ray.init(address="local", include_dashboard=False, object_store_memory=job.object_store, log_to_driver=False)
    return Pipeline(
        sources[0],
        TrainerSettings(job.config()),
        MemPSSettings(capacity_rows=mem_rows),
        SSDPSSettings(ssd_path, options={"io_threads": job.io_threads}),
        batch_size=job.batch,
        preflight=False,  # its SSD-PS holds the imported table on purpose (and the cgroup is the test)
    )


def _phase_train(p: dict) -> dict:
    import ray
    import torch

    from hpsray.bench.disk_bound import delta
    from hpsray.tiers.ssd.probe import DiskCounters

    job = Job(**p["job"])
    warm, timed = job.sources()
    with _pipeline(job, p["ssd"], p["mem_rows"], (warm, timed)) as pipe:
        pipe.fit(progress=False)
        pipe.source = timed
        actors = pipe.actors()
        before = ray.get(actors["SSDPS[node 0]"].stats.remote())
        disk0, cpu0 = DiskCounters.of(p["ssd"]), _cpu_seconds()
        report = pipe.fit(progress=False)
        disk1, cpu1 = DiskCounters.of(p["ssd"]), _cpu_seconds()
        after = ray.get(actors["SSDPS[node 0]"].stats.remote())
        ray.get(actors["MemPS[node 0]"].flush.remote())  # every trained row on SSD-PS
        store = ray.get(actors["SSDPS[node 0]"].stats.remote())["store"]
        if p.get("dense"):
            torch.save(pipe.dense_state(), p["dense"])
    return {
        "examples_per_s": report["examples_per_s"],
        "wall_s": report["wall_s"],
        "examples": report["examples"],
        "batches": report["batches"],
        "pipeline_efficiency": report.get("pipeline_efficiency"),
        "stage_busy_s": report.get("stage_busy_s"),
        "cache_hit_rate_mean": float(np.mean(list(report["cache_hit_rate"].values()))),
        "load_counts": delta(after["store"], before["store"]),  # the timed pass's loads
        "load_stage_busy_s": after.get("busy_s", 0.0) - before.get("busy_s", 0.0),
        # the same actor's writes (MEM-PS's dumps), on their own thread beside its loads
        "dump_busy_s": after["dump"].get("busy_s", 0.0) - before["dump"].get("busy_s", 0.0),
        "dumps": int(after["store"].get("dumps", 0) - before["store"].get("dumps", 0)),  # MEM-PS's writes to SSD-PS
        "device": disk1.since(disk0) if disk0 is not None and disk1 is not None else None,
        "machine_cpu_busy": (cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1e-9),  # every core's, every process's
        "ssd": {k: store[k] for k in ("live_rows", "live_bytes", "disk_bytes", "space_ratio", "bytes_read", "files")},
    }


def _cpu_seconds() -> tuple[float, float]:
    """Busy and total CPU seconds of the machine so far (``/proc/stat``; zeros where absent)."""
    try:
        with open("/proc/stat") as f:
            t = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = t[3] + (t[4] if len(t) > 4 else 0.0)
    return (sum(t) - idle) / 100.0, sum(t) / 100.0


def _phase_crash(p: dict) -> None:
    from hpsray.tiers.ssd import SSDPS

    store = SSDPS(p["store"])
    keys = np.load(p["touched"])
    rng = np.random.default_rng(0)
    print("open", flush=True)
    while True:  # rewrite rows with the values they have until killed
        k = np.unique(rng.choice(keys, 20_000))
        rows, _ = store.load(k)
        store.dump(k, rows)
        print("dumped", flush=True)


def _phase_check(p: dict) -> dict:
    from hpsray.tiers.ssd import SSDPS

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as empty:  # numba's cached kernels load here: a fixed cost
        SSDPS(empty, p["width"]).close()
    fixed = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = SSDPS(p["store"])
    reopen = time.perf_counter() - t0
    try:
        out: dict[str, Any] = {
            "reopen_s": reopen,
            "reopen_fixed_s": fixed,
            "keys": len(store),
            "key_map_bytes": store.stats["key_map_bytes"],
        }
        for name in ("touched", "sample"):
            keys = np.load(p[name])
            rows, found = store.load(keys)
            np.save(p[name + "_rows"], rows)
            out[name + "_found"] = int(found.sum())
        out["stats"] = {k: store.stats[k] for k in ("live_bytes", "disk_bytes", "space_ratio", "files")}
    finally:
        store.close()
    return out


def _main() -> None:
    phase, payload = sys.argv[1], json.loads(sys.argv[2])
    if phase == "crash":
        _phase_crash(payload)
        return
    result = {"import": _phase_import, "train": _phase_train, "check": _phase_check}[phase](payload)
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
