"""``hpsray bench serve``'s in-process parts on a small model: the figures the docs quote, and what they mean."""

from __future__ import annotations

import os

import pytest

from hpsray.bench.serve_in_process import in_process, ssd_read
from hpsray.bench.serve_workload import load_options, make_model, request_bodies


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hpsray.serving.layout import build_point_store

    d = os.path.join(tmp_path_factory.mktemp("bench-serve"), "model")
    gen = make_model(d, 26 * 2000, dim=8, hidden=(16,))
    build_point_store(d)
    return d, request_bodies(gen, 64, 6)


def test_in_process_reports_reads_per_missed_row_and_row_bytes(model):
    d, bodies = model
    out = in_process(d, bodies, 0.05, ["tiered-blocks", "driven", "rocksdb"], repeat=1)
    assert out["tiered-blocks"]["ssd_read"] == "blocks"
    for system in ("tiered-blocks", "driven"):
        s = out[system]
        assert s["examples_per_s"] > 0 and 0 < s["reads_per_missed_row"] <= 1, s
        assert s["row_bytes_in_memory"] == 4 * 8  # rows at their natural stride
    t = out["driven"]["transfers"]
    assert t["host_to_device"]["keys"] == t["device_to_host"]["probabilities"]  # one of each per batch


def test_ssd_read_compares_mapped_and_block_reads_warm_and_cold(model):
    d, bodies = model
    out = ssd_read(d, bodies, 0.05, repeat=1)
    for mode in ("mmap", "blocks"):
        assert out[mode]["warm_examples_per_s"] > 0 and out[mode]["cold_examples_per_s"] > 0
    assert out["mmap"]["reads_per_missed_row"] is None and 0 < out["blocks"]["reads_per_missed_row"] < 1
    assert set(out["blocks_vs_mmap"]) == {"warm", "cold"}


def test_the_device_tier_comes_out_of_the_five_percent():
    opts = load_options("driven", 0.05, "cpu", 0.01, rows=1000)
    assert opts.driver == "device" and opts.device_rows == 10 and abs(opts.mem_fraction - 0.04) < 1e-12
    gpu = load_options("tiered", 0.05, "cuda", 0.01, rows=1000)
    assert gpu.device == "cuda" and gpu.driver == "cpu" and gpu.device_rows == 10
    assert load_options("rocksdb", 0.05, "cuda", 0.01, rows=1000).device == "cpu"  # baselines stay on the CPU
