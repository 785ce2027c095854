"""The ``ssd`` and ``cache`` benchmarks run end to end at a tiny size and report their keys."""

from __future__ import annotations

import argparse
import json

from hpsray.bench import BENCHMARKS
from hpsray.bench import cache as cache_bench
from hpsray.bench import ssd as ssd_bench
from hpsray.blockio import queue_depth


def _args(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_benchmarks_are_registered():
    assert BENCHMARKS["ssd"] == "hpsray.bench.ssd"
    assert BENCHMARKS["cache"] == "hpsray.bench.cache"


def test_ssd_bench_reports_its_keys(tmp_path):
    report = ssd_bench.run(
        _args(
            ssd_bench,
            [
                "--size",
                "3",
                "--rows-per-file",
                "1024",
                "--dump-rows",
                "4096",
                "--overwrites",
                "3",
                "--repeat",
                "1",
                "--disk-probe-seconds",
                "0.2",
                "--dir",
                str(tmp_path),
            ],
        )
    )
    for key in ("load_bytes_per_s", "seq_read_bytes_per_s", "dump_bytes_per_s", "space_ratio"):
        assert report[key] > 0, key
    assert report["space_ratio"] <= 2.0
    assert report["load"]["files"] > 0 and report["checks"]["space_ratio_le_2"]
    # the disk's random-read bound on the store's files, per depth, and the sparse load beside it
    depth = queue_depth(4)  # what loads keep in flight: the ring's depth, else the store's 4 I/O threads
    assert set(report["disk_bound"]["by_depth"]) == {"1", "8", "32", str(depth)}
    stage = report["sparse_load_stage"]
    assert stage["reads_per_load"] > 0 and stage["queue_depth"] == depth and stage["bytes_per_row"] > 0
    assert report["load_reads_vs_disk_bound"] == stage["load_reads_vs_disk_bound"] > 0
    json.dumps(report)
    assert list(tmp_path.iterdir()) == []  # cleans up after itself


def test_ssd_bench_runs_without_overwrites(tmp_path):
    argv = ["--size", "1", "--rows-per-file", "1024", "--overwrites", "0", "--repeat", "1", "--dir", str(tmp_path)]
    argv += ["--disk-probe-seconds", "0.1"]
    report = ssd_bench.run(_args(ssd_bench, argv))
    assert report["space_ratio_max_after_dump"] == report["space_ratio"] > 0


def test_cache_bench_reports_hit_rates():
    report = cache_bench.run(_args(cache_bench, ["--size", "0.02", "--batches", "30"]))
    for trace in ("zipf", "drift"):
        rates = {p: report[trace][p]["hit_rate"] for p in ("lru_lfu", "lru", "lfu", "lfu_aged", "belady")}
        assert all(0.0 <= r <= 1.0 for r in rates.values()), rates
        assert rates["belady"] >= max(rates.values()) - 1e-12
    json.dumps(report)
