"""``hpsray bench outofcore`` at a tiny size: its report, the scale it reaches, and that the
out-of-core run trains exactly the rows of the in-memory run (lossless)."""

from __future__ import annotations

import argparse
import json

from hpsray.bench import BENCHMARKS, outofcore


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    outofcore.add_arguments(p)
    return p.parse_args(argv)


def test_outofcore_bench_is_lossless_at_40x(tmp_path):
    assert BENCHMARKS["outofcore"] == "hpsray.bench.outofcore"
    report = outofcore.run(
        _args(
            [
                "--rows",
                "48000",
                "--batch",
                "256",
                "--minibatch",
                "256",
                "--warmup-batches",
                "2",
                "--slots",
                "4",
                "--zipf",
                "0.8",
                "--keys",
                "400000",
                "--dense",
                "2",
                "--hidden",
                "8",
                "--dir",
                str(tmp_path),
                "--report-dir",
                str(tmp_path / "report"),
            ]
        )
    )
    json.dumps(report)
    for key in (
        "examples_per_s",
        "in_memory_examples_per_s",
        "ratio_vs_in_memory",
        "scale_factor",
        "model_rows",
        "budget_rows",
        "cache_hit_rate_mean",
        "ssd_io_s_per_batch",
        "compactions",
        "checks",
        "lossless",
    ):
        assert key in report, key
    assert report["scale_factor"] >= 40, report["scale_factor"]
    assert report["model_rows"] >= 40 * report["budget_rows"]
    ooc = report["out_of_core"]
    assert ooc["rows_loaded_from_ssd"] > 0 and ooc["rows_evicted_dirty"] > 0  # rows really went out and back
    assert report["in_memory"]["rows_evicted"] == 0
    assert report["lossless"]["same_keys"] and report["lossless"]["equal"], report["lossless"]
    assert report["checks"]["lossless"] and report["checks"]["scale_ge_40"]
    names = {p.name for p in (tmp_path / "report").iterdir()}
    assert {
        "outofcore.json",
        "outofcore.stage_times.png",
        "outofcore.cache_hit_rate.png",
        "outofcore.ssd_io.png",
        "inmemory.json",
        "summary.json",
    } <= names


def test_outofcore_bench_with_three_tables_is_lossless_and_reports_each(tmp_path):
    """``--tables 3`` (issue 43): tables of their own dims (16, 8, 4), optimizers and poolings;
    the biggest table alone >= 20x the MEM-PS budget, each table's rows and figures reported at
    its own row bytes, the two runs equal."""
    report = outofcore.run(
        _args(
            ["--rows", "60000", "--batch", "256", "--minibatch", "256", "--warmup-batches", "2", "--slots", "4"]
            + ["--zipf", "0.8", "--keys", "400000", "--dense", "2", "--hidden", "8", "--tables", "3"]
            + ["--dir", str(tmp_path)]
        )
    )
    json.dumps(report)
    tables = report["tables"]
    assert list(tables) == ["t0", "t1", "t2"] and [t["slots"] for t in tables.values()] == [2, 1, 1]
    assert sum(t["rows"] for t in tables.values()) == report["model_rows"]
    assert tables["t0"]["scale_factor"] >= 20 and report["checks"]["biggest_table_ge_20x"]
    assert all(t["ssd_rows_loaded"] > 0 for t in tables.values())  # every table's rows went out and back
    assert [t["dim"] for t in tables.values()] == [16, 8, 4]
    assert [t["row_bytes"] for t in tables.values()] == [4 * 32, 4 * 16, 4 * 12]  # Adagrad, Adagrad, Adam
    assert report["lossless"]["equal"], report["lossless"]
    assert "throughput_ge_85pct_in_memory" in report["checks"]
