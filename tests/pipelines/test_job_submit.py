"""``ray job submit -- hpsray train`` against a real ``ray start --head`` cluster (token auth on)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    """A port free on every address: the head's agents bind the node's address or all of them, so
    a port free on 127.0.0.1 alone may be a Ray worker's on the node's address already."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A head node in its own process group, stopped by signal (``ray stop`` would stop every Ray
    here); one for the module (starting and stopping one takes half a minute each)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    gcs, dash = free_port(), free_port()
    temp = Path("/tmp") / f"hpsray-job-{os.getpid()}"
    temp.mkdir(parents=True, exist_ok=True)
    # the head's output to a file: a pipe nobody reads fills up and blocks `ray start --block`
    log = open(temp.with_name(temp.name + ".log"), "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--num-cpus=2",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            # own agent ports: another Ray on this machine (the tests' local one) holds the defaults,
            # and a head whose job agent cannot bind answers every submission "No available agent"
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run([RAY, "job", "list", "--address", address], env=env, capture_output=True, text=True)
        if probe.returncode == 0:
            break
        if proc.poll() is not None:
            pytest.fail(f"ray start --head exited: {head_output(log)}")
        time.sleep(2)
    else:
        pytest.fail("the head node's job server did not come up in 120 s")
    yield address, env, log
    try:  # the head's whole process group at once: its graceful stop takes half a minute
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    log.close()
    os.unlink(log.name)
    shutil.rmtree(temp, ignore_errors=True)


def head_output(log) -> str:
    """The end of what the head node printed (its reason, where it stopped), and of its
    dashboard agent's log (the job agent that takes submissions lives there)."""
    log.flush()
    out = Path(log.name).read_text()[-3000:]
    for agent in sorted(Path(log.name.removesuffix(".log")).glob("session_*/logs/dashboard_agent.log")):
        out += f"\n{agent}:\n" + agent.read_text(errors="replace")[-3000:]
    return out


def test_hpsray_train_runs_as_a_submitted_job(head, tmp_path):
    address, env, log = head
    report = tmp_path / "run.json"
    job = tmp_path / "job.toml"
    example = (ROOT / "examples" / "train.toml").read_text()
    assert "rows = 200000" in example
    job.write_text(example.replace("rows = 200000", "rows = 20000"))  # the example job, smaller
    deadline = time.time() + 120
    while True:  # `ray job list` answers before the node's job agent takes submissions
        out = subprocess.run(
            [
                RAY,
                "job",
                "submit",
                "--address",
                address,
                "--",
                sys.executable,
                "-m",
                "hpsray",
                "train",
                str(job),
                "--report",
                str(report),
                "--quiet",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if "No available agent to submit job" not in out.stdout + out.stderr or time.time() > deadline:
            break
        time.sleep(3)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + "\nhead node:\n" + head_output(log)
    assert "succeeded" in out.stdout + out.stderr
    result = json.loads(report.read_text())
    assert result["examples"] > 0 and result["batches"] >= 1
    assert 0.5 < result["auc"] <= 1.0


def test_submission_without_token_mode_is_refused(head):
    address, env, log = head
    plain = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run(
        [RAY, "job", "submit", "--address", address, "--", "true"],
        env=plain,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "authentication" in (out.stdout + out.stderr).lower(), head_output(log)
