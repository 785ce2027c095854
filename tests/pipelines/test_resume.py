"""``hpsray train --resume``, Ctrl-C and ``--export DIR --incremental``, as a user runs them.

A driver (``hpsray train JOB.toml`` in a session of its own, with its embedded local Ray) is
killed with its whole process group once a checkpoint of batch >= 6 is committed, or sent one
SIGINT (Ctrl-C: exit code 130, a checkpoint, the ``--resume`` command printed); ``hpsray train
JOB.toml --resume`` then ends equal to the reference trainer on the same data. The resumes run
in-process on the session's Ray (``ray_local``): the same code as the command, one Ray start less.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpsray.checkpoint import Checkpoints
from hpsray.data import PlantedCTR, write_synthetic
from hpsray.data.generate import to_toml
from hpsray.export import export_chain, load_export
from hpsray.job import JobConfig, build

ROWS, BATCH = 10000, 500  # 20 batches
KILL_AT = 6  # the driver dies once a checkpoint of this batch (or later) is committed
JOB = {
    "data.synthetic": {"rows": ROWS, "slots": 4, "keys": 2000, "dense": 3, "seed": 5},
    "model": {"dim": 4, "hidden": [8]},
    "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
    "tiers": {"mem_rows": 1500},  # rows travel to SSD-PS and back
    "tiers.ssd": {"rows_per_file": 256},
    "pipeline": {"batch_size": BATCH, "minibatch_size": 250},
}
CHECKPOINT = {"dir": "ckpt", "every_batches": 2, "keep": 2, "max_failures": 1}
_COMMITTED = re.compile(r"ckpt-(\d{6,})")


def write_job(directory: Path, checkpoint: dict | None = CHECKPOINT, rows: int = ROWS, seed: int = 5) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    job = {**JOB, "data.synthetic": {**JOB["data.synthetic"], "rows": rows, "seed": seed}}
    if checkpoint is not None:
        job["checkpoint"] = checkpoint
    path = directory / "job.toml"
    path.write_text(to_toml(job))
    return path


def main(*args: str) -> int:
    from hpsray.__main__ import main as hpsray_main

    return hpsray_main(["train", *args])


# -- the driver's processes ------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int, str] | None:
    """``(ppid, session id, state)`` of a process, ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3]), fields[0]


def family(root: int) -> set[int]:
    """The processes of ``root``'s session and every descendant of ``root`` (Ray's GCS, raylet,
    dashboard and workers of an embedded Ray), zombies left out."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    live = {pid: s for pid, s in stats.items() if s[2] != "Z"}
    found = {pid for pid, (_, sid, _) in live.items() if sid == root}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in live.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found - {root}


def gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = {pid for pid in pids if (s := _stat(pid)) is not None and s[2] != "Z"}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def end_driver(proc: subprocess.Popen, timeout: float = 30.0) -> set[int]:
    """SIGKILL ``proc``'s process group and every process of its family; wait until all are gone.
    Returns those still there after ``timeout`` (none, normally)."""
    members = family(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout)
    return gone(members, timeout)


def start_driver(job: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """``hpsray train JOB --quiet`` in a new session (its own process group); output to a file."""
    log = job.parent / "driver.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpsray", "train", str(job), "--quiet", "--no-plan", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return proc, log


def newest_checkpoint(directory: Path) -> int:
    if not directory.is_dir():
        return -1
    return max((int(m.group(1)) for e in os.listdir(directory) if (m := _COMMITTED.fullmatch(e))), default=-1)


def wait_for_checkpoint(proc: subprocess.Popen, directory: Path, log: Path, batch: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = newest_checkpoint(directory)
        if newest >= batch:
            return newest
        if proc.poll() is not None:
            pytest.fail(
                f"the driver ended (code {proc.returncode}) before checkpoint {batch}:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.02)
    pytest.fail(f"no checkpoint of batch >= {batch} within {timeout} s:\n{log.read_text()[-3000:]}")


# -- the reference ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The reference trainer's export of the job's data (``hpsray train --reference``, no Ray)."""
    root = tmp_path_factory.mktemp("reference")
    job = write_job(root, checkpoint=None)
    assert main(str(job), "--reference", "--export", str(root / "export"), "--quiet") == 0
    return root / "export"


def assert_equal_exports(got: Path, want: Path) -> None:
    keys, rows, dense = load_export(got)
    ref_keys, ref_rows, ref_dense = load_export(want)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=0, atol=1e-5)
    assert set(dense) == set(ref_dense)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=0, atol=1e-5, err_msg=name)


def resume_and_compare(job: Path, reference: Path, capsys, at_least: int, *export_args: str) -> dict:
    """``hpsray train JOB --resume --compare REF --report ...`` in-process (with ``export_args``,
    else ``--export DIR/resumed``): equal to the reference. Returns the run report."""
    report_file = job.parent / "resumed.json"
    export_args = export_args or ("--export", str(job.parent / "resumed"))
    code = main(
        str(job), "--resume", *export_args, "--compare", str(reference), "--report", str(report_file), "--no-plan"
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:] + printed.out[-3000:]
    assert "EQUAL within 1e-05" in printed.out
    report = json.loads(report_file.read_text())
    assert report["resumed_from"]["batch"] >= at_least
    assert report["resumed_from"]["checkpoint"].startswith(str(job.parent / "ckpt"))
    assert f"resuming from {report['resumed_from']['checkpoint']}" in printed.err
    assert report["checkpoints"]["count"] >= 1 and report["recovery"] == []
    assert re.search(r"^checkpoints: \d+ written in .* % of wall", printed.out, re.M), printed.out
    assert_equal_exports(Path(export_args[1]), reference)
    return report


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_the_driver_and_its_ray_are_killed_ends_equal_to_the_reference(
    tmp_path, reference, ray_local, capsys
):
    job = write_job(tmp_path)
    proc, log = start_driver(job)
    try:
        newest = wait_for_checkpoint(proc, tmp_path / "ckpt", log, KILL_AT)
        assert family(proc.pid), "the driver started no Ray processes"
    finally:
        left = end_driver(proc)
    assert not left, f"processes of the killed driver still alive: {sorted(left)}"
    assert proc.returncode == -signal.SIGKILL
    assert newest < ROWS // BATCH  # killed before it finished
    resume_and_compare(job, reference, capsys, at_least=KILL_AT)


@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_130_and_resume_ends_equal_to_the_reference(tmp_path, reference, ray_local, capsys):
    """A daily job exporting deltas into its serving directory (``--export DIR --incremental`` on
    top of an earlier model, here the reference's) is stopped with Ctrl-C; the command it prints
    continues it, and the directory then loads as the finished model."""
    job = write_job(tmp_path)
    served = tmp_path / "served"
    shutil.copytree(reference, served)
    proc, log = start_driver(job, "--export", str(served), "--incremental")
    try:
        wait_for_checkpoint(proc, tmp_path / "ckpt", log, KILL_AT)
        ray_processes = family(proc.pid)
        os.kill(proc.pid, signal.SIGINT)  # the driver only, as a terminal's Ctrl-C reaches it
        code = proc.wait(timeout=120)
        left = gone(ray_processes, 30)  # its embedded Ray stopped with it
    finally:
        end_driver(proc)  # whatever is left, if anything
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert ray_processes and not left, f"processes of the interrupted driver still alive: {sorted(left)}"
    stopped = re.search(r"interrupted: stopped after (\d+) batches trained, every trained row written back", text)
    assert stopped, text[-3000:]
    done = int(stopped.group(1))
    assert f"resume from its checkpoint (ckpt-{done:06d})" in text, text[-3000:]
    assert f"the newest checkpoint is {tmp_path / 'ckpt' / f'ckpt-{done:06d}'}" in text, text[-3000:]
    command = f"hpsray train {job} --resume --export {served} --incremental"
    assert f"continue with: {command}" in text, text[-3000:]
    assert newest_checkpoint(tmp_path / "ckpt") == done < ROWS // BATCH
    assert export_chain(served) == [str(served)]  # nothing exported by the interrupted run
    report = resume_and_compare(job, reference, capsys, done, *command.split()[4:])
    assert report["resumed_from"]["batch"] == done
    assert report["export"]["sequence"] == 1 and export_chain(served) == [str(served), str(served / "delta-000001")]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpsray train: error: ") and "\n" not in err, err
    return err


def test_resume_refuses_a_job_without_checkpoints_an_empty_directory_and_another_jobs(tmp_path, capsys):
    """Each refusal is one line naming the directory, before Ray starts (these run in-process)."""
    bare = write_job(tmp_path / "bare", checkpoint=None)
    assert main(str(bare), "--resume") == 2
    assert "checkpoint.dir: missing: the job has no [checkpoint] dir to resume from" in one_line_error(capsys)

    job = write_job(tmp_path / "job")
    ckpt = tmp_path / "job" / "ckpt"
    assert main(str(job), "--resume") == 2
    assert f"--resume: {ckpt}: no such directory" in one_line_error(capsys)
    ckpt.mkdir()
    assert main(str(job), "--resume") == 2
    assert f"--resume: {ckpt}: no checkpoint to resume from" in one_line_error(capsys)

    # another job's checkpoint (committed here with another fingerprint: no Ray needed)
    checkpoints = Checkpoints(ckpt)
    with checkpoints.staged(4) as staging:
        (staging / "dense.pt").write_bytes(b"x")
        checkpoints.commit(staging, 4, {"pass_first": 0}, fingerprint="0123456789abcdef")
    assert main(str(job), "--resume") == 2
    err = one_line_error(capsys)
    assert f"--resume: {ckpt / 'ckpt-000004'}: written by another job" in err, err
    # a new run (no --resume) refuses to overwrite them
    assert main(str(job)) == 2
    err = one_line_error(capsys)
    assert f"checkpoint.dir: {ckpt}: holds checkpoints of another job" in err and "ckpt-000004" in err, err

    # the arguments
    assert main(str(job), "--incremental") == 2
    assert "--incremental needs --export DIR" in one_line_error(capsys)
    assert main(str(job), "--reference", "--resume") == 2
    assert "--resume continues a pipeline run" in one_line_error(capsys)


def test_the_fingerprint_is_the_same_in_another_driver_process(tmp_path):
    """A resume runs in a new driver: the job's fingerprint (repr of config and source) must not
    depend on the process (no object addresses, no hash randomisation)."""
    write_synthetic(str(tmp_path / "data"), PlantedCTR(n_slots=3, keys_per_slot=20, n_dense=2, seed=1), 100, "criteo")
    synthetic = write_job(tmp_path / "syn")
    files = tmp_path / "files.toml"
    files.write_text('[data]\npaths = ["data"]\n[data.bad_input]\nmode = "strict"\n[checkpoint]\ndir = "ckpt"\n')
    code = (
        "import sys; from hpsray.job import JobConfig, build\n"
        "for p in sys.argv[1:]: print(build.pipeline(JobConfig.load(p)).fingerprint)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # not this process's string hashes
    there = subprocess.run(
        [sys.executable, "-c", code, str(synthetic), str(files)], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    here = [build.pipeline(JobConfig.load(p)).fingerprint for p in (synthetic, files)]
    assert there == here and here[0] != here[1]
    changed = JobConfig.load(synthetic)
    changed = dataclasses.replace(changed, optimizer=dataclasses.replace(changed.optimizer, sparse_lr=0.1))
    assert build.pipeline(changed).fingerprint != here[0]  # another job's checkpoints are refused


def test_incremental_exports_load_as_a_full_export_of_the_final_model(tmp_path, capsys):
    """``--export DIR --incremental`` on each run (the reference trainer: no Ray, bit for bit
    reproducible): a full export first, then a delta for a run on more data and one for another
    job; ``load_export(DIR)`` equals a full export of the last run's model."""
    first = write_job(tmp_path / "first", checkpoint=None, rows=2000)
    more = write_job(tmp_path / "more", checkpoint=None, rows=3000)
    other = write_job(tmp_path / "other", checkpoint=None, rows=2000, seed=6)
    out = tmp_path / "export"

    def train(job: Path, *args: str) -> dict:
        assert main(str(job), "--reference", *args, "--quiet", "--json") == 0, capsys.readouterr().err[-3000:]
        return json.loads(capsys.readouterr().out)

    assert "sequence" not in train(first, "--export", str(out), "--incremental")["export"]  # none there: a full one
    for seq, job in enumerate((more, other), 1):
        delta = train(job, "--export", str(out), "--incremental")["export"]
        full = tmp_path / f"full-{seq}"
        train(job, "--export", str(full))
        assert delta["format"] == "hpsray-export-delta" and delta["sequence"] == seq
        assert export_chain(out)[-1] == str(out / f"delta-{seq:06d}")
        keys, rows, dense = load_export(out)
        want_keys, want_rows, want_dense = load_export(full)
        assert np.array_equal(keys, want_keys) and np.array_equal(rows, want_rows)
        assert all(np.array_equal(dense[n].numpy(), want_dense[n].numpy()) for n in want_dense)
        assert delta["rows"] == keys.size and 0 < delta["changed"] <= keys.size
        assert (delta["removed"] > 0) == (job is other)  # another job's stream lacks some keys


def test_the_summary_has_a_line_for_checkpoints_and_one_per_recovery(tmp_path, capsys):
    from hpsray.cli.train import summary

    job = write_job(tmp_path, checkpoint=None, rows=1000)
    assert main(str(job), "--reference", "--quiet", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    report["checkpoints"] = {"count": 4, "seconds": 1.5, "mean_seconds": 0.375, "share_of_wall": 0.125, "bytes": 2.5e6}
    lost = {"dead": ["Trainer[node 0]"], "error": "ActorDiedError: gone", "restart_s": 2.0, "restarted": []}
    report["recovery"] = [
        {**lost, "failed_at_batch": 13, "resumed_from_batch": 12, "replayed_batches": 1},
        {**lost, "dead": [], "failed_at_batch": 20, "resumed_from_batch": 16, "replayed_batches": 4},
    ]
    lines = summary(report).splitlines()
    assert "checkpoints: 4 written in 1.5 s, 12.5 % of wall, 2.5 MB referenced" in lines
    assert [line for line in lines if line.startswith("recovery: ")] == [
        "recovery: Trainer[node 0] lost after 13 batches trained (ActorDiedError: gone); resumed from the checkpoint "
        "after 12 batches, 1 batch replayed, restarted in 2.0 s",
        "recovery: an actor lost after 20 batches trained (ActorDiedError: gone); resumed from the checkpoint "
        "after 16 batches, 4 batches replayed, restarted in 2.0 s",
    ]
