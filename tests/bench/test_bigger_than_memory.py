"""``hpsray bench bigger-than-memory`` at a tiny size: every process in a real memory cgroup, a
store imported from Parquet, trained, killed, reopened; the report's keys and its lossless check."""

from __future__ import annotations

import argparse
import os

import pytest

from hpsray.bench import BENCHMARKS, bigger_than_memory
from hpsray.bench.disk_bound import read_bound
from hpsray.blockio import queue_depth

KEYS = (
    "model_bytes_on_disk",
    "memory_limit_bytes",
    "peak_memory_bytes",
    "examples_per_s",
    "in_memory_examples_per_s",
    "disk_high_water_vs_live",
    "key_map_bytes_per_key",
    "reopen_seconds_per_100m_keys",
)


def _cgroups() -> bool:
    if os.geteuid() != 0:
        return False
    return (
        os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        or "memory" in open("/sys/fs/cgroup/cgroup.controllers").read()
    )


def test_the_read_bound_is_the_in_memory_batch_over_the_misses_reads():
    """A batch of 100k distinct keys at 10 µs of disk a missed row, beside an in-memory batch of
    0.42 s: 60k misses (0.6 s) allow 0.7x, 50k (0.5 s) 0.84x; no misses, or reads faster than the
    in-memory batch, cap at 1."""
    got = read_bound(100_000, {"measured": 0.4, "belady": 0.5, "unbounded": 1.0}, 1e-5, 0.42)
    by = got["by_hit_rate"]
    assert by["measured"]["missed_rows_per_batch"] == pytest.approx(60_000)
    assert by["measured"]["disk_s_per_batch"] == pytest.approx(0.6)
    assert by["measured"]["vs_in_memory_at_most"] == pytest.approx(0.7)
    assert by["belady"]["vs_in_memory_at_most"] == pytest.approx(0.84)
    assert by["unbounded"]["disk_s_per_batch"] == 0 and by["unbounded"]["vs_in_memory_at_most"] == 1.0
    assert read_bound(1000, {"measured": 0.5}, 1e-5, 0.42)["by_hit_rate"]["measured"]["vs_in_memory_at_most"] == 1.0
    assert got["in_memory_s_per_batch"] == 0.42 and got["disk_s_per_missed_row"] == 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not _cgroups(), reason="needs root and a memory cgroup controller")
def test_bench_runs_in_a_cgroup_and_is_lossless(tmp_path):
    assert BENCHMARKS["bigger-than-memory"] == "hpsray.bench.bigger_than_memory"
    p = argparse.ArgumentParser()
    bigger_than_memory.add_arguments(p)
    argv = ["--memory-limit", "3GiB", "--ratio", "0.02", "--dim", "8", "--slots", "4", "--dense", "2"]
    argv += ["--hidden", "8", "--examples", "8000", "--batch", "2000", "--minibatch", "1000", "--warmup-batches", "1"]
    argv += ["--mem-rows", "12800", "--sample", "500", "--object-store", "128MiB", "--dir", str(tmp_path / "w")]
    report = bigger_than_memory.run(p.parse_args(argv))
    for key in KEYS:
        assert report[key] > 0, key
    assert report["lossless"]["equal"] is True, report["lossless"]  # how many rows differ, and by how much
    assert report["lossless"]["touched_rows"] > 1000 and report["lossless"]["untouched_sampled"] == 500
    assert report["oom_kills"] == 0 and report["peak_within_limit"]
    assert report["phases"]["check"]["touched_found"] == report["lossless"]["touched_rows"]  # all imported
    assert report["key_map_bytes_per_key"] <= 30  # the compact map: 16 bytes a slot, at least 53 % full
    # the disk's random-read bound on the store's files, and the timed pass's load stage beside it
    depth = str(queue_depth(4))  # what loads keep in flight: the ring's depth, else the store's 4 I/O threads
    assert set(report["disk_bound"]["by_depth"]) == {"1", "8", "32", depth}
    assert all(d["reads_per_s"] > 0 for d in report["disk_bound"]["by_depth"].values())
    stage = report["load_stage"]
    assert stage["loads"] > 0 and stage["reads_per_load"] > 0 and stage["bytes_per_row"] > 0
    # MEM-PS's evictions reach SSD-PS in the timed pass (12,800 rows: the batches in flight fit, the
    # 15,882 rows the run touches do not), and the load actor's clock of those writes saw them
    assert stage["dumps_per_batch"] > 0 and stage["dump_busy_s_per_batch"] > 0, stage
    assert str(stage["queue_depth"]) == depth
    assert stage["disk_reads_per_s"] == report["disk_bound"]["by_depth"][depth]["reads_per_s"]
    assert report["load_reads_vs_disk_bound"] == stage["load_reads_vs_disk_bound"] > 0
    assert stage["planned_cold_share"] == 0.0  # a 60 MB store under a 3 GiB limit: the page cache holds it
    assert stage["planned_disk_s_per_load"] == 0.0
    hit = stage["hit_rate"]  # the timed pass's, beside what any MEM-PS policy could hit on its trace
    assert hit["capacity_rows"] == 12800 and 0 < hit["measured"] <= hit["belady"] + 0.01
    assert hit["belady"] <= hit["unbounded"] < 1  # Belady's optimum at this capacity; no eviction
    # the page cache holds this store: no miss waits for the disk, so nothing bounds the ratio below 1
    bound = report["read_bound"]
    assert set(bound["by_hit_rate"]) == {"measured", "belady", "unbounded"}
    assert bound["by_hit_rate"]["measured"]["hit_rate"] == hit["measured"]
    assert bound["distinct_keys_per_batch"] > 0 and bound["disk_s_per_missed_row"] == 0.0
    assert report["vs_in_memory_read_bound"] == bound["by_hit_rate"]["belady"]["vs_in_memory_at_most"] == 1.0
    assert (stage["device"] is None) == ("device_bytes_per_row" not in stage)  # no block device: no counters
    assert not os.path.exists(tmp_path / "w")  # big files removed
