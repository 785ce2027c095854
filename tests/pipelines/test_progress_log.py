"""Progress where no terminal watches (issue 31): ``hpsray train`` with stderr to a file logs
progress lines with their figures in order, and its report says how long the start took."""

import json
import os
import re
import subprocess
import sys

import pytest

from hpsray.data.generate import to_toml
from hpsray.pipelines.progress import ENV, format_line, progress_seconds

# the fields of a line, in order (docs/operations.md: Progress)
LINE = re.compile(
    r"hpsray\.progress: progress: batches (?P<batches>[\d,]+), examples (?P<examples>[\d,]+)/8,000 \(\d+%\), "
    r"(?P<rate>[\d,]+) examples/s over [\d.]+ s, loss (?P<loss>[\d.]+), "
    r"slowest stage (?P<stage>read|pull|load|train) \(busy [\d.]+ s, \d+%\), "
    r"MEM-PS hit rate [\d.]+, SSD-PS read [\d.]+ \w+ written [\d.]+ \w+, ETA \d+:\d\d:\d\d, checkpoint (?P<ckpt>\S+)"
)
END = re.compile(
    r"hpsray\.progress: pass end: batches 16, examples 8,000/8,000 \(100%\), [\d,]+ examples/s over [\d.]+ s, "
    r"loss [\d.]+, slowest stage \w+ .*, MEM-PS hit rate [\d.]+, SSD-PS read .* written .*, checkpoint \S+ckpt-000016"
)


def test_train_logs_progress_lines_when_stderr_is_a_file(tmp_path):
    job = {
        "data.synthetic": {"rows": 8000, "eval_rows": 500, "slots": 4, "keys": 2000, "dense": 2},
        "model": {"dim": 4, "hidden": [8]},
        "tiers": {"mem_rows": 3000},  # below the distinct keys: rows go to SSD-PS and back
        "pipeline": {"batch_size": 500, "minibatch_size": 250, "progress_seconds": 0.05},
        "checkpoint": {"dir": "ckpt", "every_batches": 4},
    }
    (tmp_path / "job.toml").write_text(to_toml(job))
    stderr = tmp_path / "stderr.log"
    env = {**os.environ, ENV: "3600"}  # the job's own setting wins over the environment
    with open(stderr, "w") as err:
        out = subprocess.run(
            [sys.executable, "-m", "hpsray", "train", str(tmp_path / "job.toml"), "--report", str(tmp_path / "r.json")],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )
    log = stderr.read_text()
    assert out.returncode == 0, log[-3000:]
    lines = [m for m in map(LINE.search, log.splitlines()) if m]
    assert len(lines) >= 2, log[-3000:]
    done = [int(m["examples"].replace(",", "")) for m in lines]
    assert done == sorted(done) and all(0 < n < 8000 for n in done)
    assert all(int(m["rate"].replace(",", "")) > 0 for m in lines)
    assert all(0 < float(m["loss"]) < 1 for m in lines)  # the training loss over each interval
    assert any(m["ckpt"].endswith("ckpt-000004") or m["ckpt"].endswith("ckpt-000008") for m in lines)
    assert END.search(log), log[-3000:]
    assert "\r" not in log  # no bar written into the file

    report = json.loads((tmp_path / "r.json").read_text())
    start = report["start"]
    assert 0 < start["ray_init_s"] and 0 < start["actors_s"]
    assert report["time_to_first_batch_s"] >= start["ray_init_s"] + start["actors_s"]
    assert f"time to first batch {report['time_to_first_batch_s']:.2f} s (Ray " in out.stdout


def test_progress_seconds_comes_from_the_job_then_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert progress_seconds() == 30.0
    monkeypatch.setenv(ENV, "5")
    assert progress_seconds() == 5.0
    assert progress_seconds(0.5) == 0.5
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match=ENV):
        progress_seconds()
    with pytest.raises(ValueError, match="progress_seconds"):
        progress_seconds(-1.0)


def test_a_line_without_stage_figures_or_known_size():
    line = format_line(3, 1500, None, 750.0, 2.0, None, None)
    assert line == "progress: batches 3, examples 1,500, 750 examples/s over 2.0 s, checkpoint none"
