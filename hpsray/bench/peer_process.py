"""One system of ``hpsray bench peers`` in its own process: ``python -m hpsray.bench.peer_process SPEC``.

Reads the :class:`~hpsray.bench.baselines.PeerSpec` JSON, trains that system (hpsray on a fresh
local Ray, the in-memory sharded PS, or an in-process peer) and writes its result beside the spec.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hpsray.bench.baselines import PeerSpec, peak_rss_bytes, write_result

if TYPE_CHECKING:
    from hpsray.data.batch import Batch

CEILING = "mlp_alone"  # the MLP alone on its batches: the ceiling every system is compared with


class PreparedSource:
    """Batches already in Ray's object store (refs), for a pipeline's reader: the reader then
    only fetches them (zero-copy), as every peer reads its examples from memory."""

    def __init__(self, refs: list, batch_size: int, n_slots: int, n_dense: int) -> None:
        self.refs, self.batch_size, self.n_slots, self.n_dense = list(refs), batch_size, n_slots, n_dense

    def open(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> Iterator[Batch]:
        import ray

        if batch_size != self.batch_size:
            raise ValueError(f"PreparedSource holds batches of {self.batch_size} examples, asked for {batch_size}")
        for ref in self.refs[reader_index::num_readers]:
            yield ray.get(ref)


def _put_batches(batch: Batch, spec: PeerSpec, start: int, stop: int | None, size: int) -> list:
    import ray

    from hpsray.bench.baselines import split

    return [ray.put(b) for b in split(batch, size, start, stop)]


def _start_ray(spec: PeerSpec) -> None:
    """A fresh local Ray for this system alone (never a cluster that happens to run here), started
    again within ``$HPSRAY_RAY_START_SECONDS`` when a loaded machine's start fails.

    Ray 2.60 runs its workers at niceness 15; the other peers run at the shell's niceness, so on
    a machine with other load the actors would lose the CPU to it. ``spec.extra["ray_worker_niceness"]``
    (``--ray-worker-niceness``, default 0) evens that out.
    """
    import ray

    from hpsray.cluster.runtime import start_seconds, with_retries

    niceness = spec.extra.get("ray_worker_niceness")
    system_config = {} if niceness is None else {"worker_niceness": int(niceness)}
    with_retries(  # a loaded machine's GCS may not answer the first start in time
        lambda: ray.init(address="local", include_dashboard=False, log_to_driver=False, _system_config=system_config),
        "starting a local Ray for a peer",
        start_seconds(),
        ray.shutdown,
    )


def run_hpsray(spec: PeerSpec) -> dict:
    """The hpsray pipeline on ``spec``'s examples (MEM-PS budget ``spec.mem_capacity_rows``)."""
    import ray

    from hpsray.bench.baselines import load_examples, ray_peak_rss
    from hpsray.pipelines import MemPSSettings, Pipeline, TrainerSettings

    _start_ray(spec)
    try:
        cfg = spec.train_config()
        train = load_examples(spec, "train")
        warm = _put_batches(train, spec, 0, spec.warmup_rows, spec.batch)
        measured = _put_batches(train, spec, spec.warmup_rows, spec.warmup_rows + spec.rows, spec.batch)
        held_out = _put_batches(load_examples(spec, "eval"), spec, 0, None, spec.batch)
        del train
        src = lambda refs: PreparedSource(refs, spec.batch, spec.n_slots, spec.n_dense)  # noqa: E731
        capacity = spec.mem_capacity_rows or spec.vocabulary_rows + 1024
        trainer = TrainerSettings(cfg, threads=spec.threads, device=spec.device)
        if spec.extra.get("stage_niceness") is not None:  # --stage-niceness
            trainer = dataclasses.replace(trainer, stage_niceness=int(spec.extra["stage_niceness"]))
        trainer = dataclasses.replace(trainer, stage_idle=bool(spec.extra.get("stage_idle")))  # --stage-idle
        with Pipeline(
            src(warm),
            trainer,
            MemPSSettings(capacity_rows=capacity),
            batch_size=spec.batch,
        ) as p:
            p.fit(progress=False)
            p.source = src(measured)
            report = p.fit(progress=False)
            ev = p.evaluate(src(held_out))
            rss = ray_peak_rss(p.actors())
        cache = report.get("cache") or {}
        ssd = report.get("ssd") or {}
        return {
            "examples_per_s": report["examples_per_s"],
            "auc": ev["auc"],
            "logloss": ev["logloss"],
            **rss,
            "examples": report["examples"],
            "train_s": report["wall_s"],
            "pipeline_efficiency": report["pipeline_efficiency"],
            "stage_busy_s": report["stage_busy_s"],
            "batch": spec.batch,
            "mem_capacity_rows": capacity,
            "mem_capacity_fraction_of_table": capacity / spec.vocabulary_rows,
            "cache_hit_rate": cache.get("hit_rate"),
            "ssd_bytes_read": ssd.get("bytes_read"),
            "ssd_bytes_written": ssd.get("bytes_written"),
            "report": report,
        }
    finally:
        ray.shutdown()


def run_sharded_ps(spec: PeerSpec) -> dict:
    """The in-memory sharded PS baseline on ``spec``'s examples."""
    import ray

    from hpsray.bench.baselines import load_examples, ray_peak_rss
    from hpsray.bench.baselines.sharded_ps import ShardedPS

    _start_ray(spec)
    try:
        train = load_examples(spec, "train")
        warm = _put_batches(train, spec, 0, spec.warmup_rows, spec.batch)
        measured = _put_batches(train, spec, spec.warmup_rows, spec.warmup_rows + spec.rows, spec.batch)
        held_out = _put_batches(load_examples(spec, "eval"), spec, 0, None, spec.batch)
        del train
        ps = ShardedPS(
            spec.train_config(),
            spec.n_slots,
            spec.n_dense,
            capacity=spec.vocabulary_rows,
            n_shards=spec.shards,
            threads=spec.threads,
        )
        ps.fit(warm)
        t0 = time.perf_counter()
        done = ps.fit(measured)
        wall = time.perf_counter() - t0
        ev = ps.evaluate(held_out)
        rss = ray_peak_rss(ps.actors())
        stats = ps.stats()
        ps.shutdown()
        return {
            "examples_per_s": done["examples"] / wall,
            "auc": ev["auc"],
            "logloss": ev["logloss"],
            **rss,
            "examples": done["examples"],
            "train_s": wall,
            "shards": spec.shards,
            "pull_wait_s": stats["trainer"]["pull_wait_s"],
            "shard_busy_s": [s["busy_s"] for s in stats["shards"]],
        }
    finally:
        ray.shutdown()


def run_one(spec: PeerSpec) -> dict:
    """Run ``spec.system`` (not TorchRec, which has its own runner) in this process."""
    if spec.system in ("hpsray_in_memory", "hpsray_ssd"):
        return run_hpsray(spec)
    if spec.system == "pytorch":
        from hpsray.bench.baselines.plain_torch import run_peer

        return run_peer(spec)
    if spec.system == "sharded_ps":
        return run_sharded_ps(spec)
    if spec.system == CEILING:
        from hpsray.bench.baselines.plain_torch import run_mlp_alone

        return run_mlp_alone(spec)
    raise ValueError(f"no in-process runner for system {spec.system!r}")


def _main(spec_path: str) -> None:
    spec = PeerSpec.from_json(Path(spec_path).read_text())
    result = run_one(spec)
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    write_result(spec, result)


if __name__ == "__main__":
    _main(sys.argv[1])
