"""The stage actors' OpenMP threads sleep when idle (docs/operations.md: Threads): an actor
process imports ``hpsray.actors`` before torch, which sets ``OMP_WAIT_POLICY=PASSIVE`` unless the
user set it; a process whose OpenMP runtime already started (torch first) is left alone."""

import os
import subprocess
import sys

import pytest

SHOW = "import os; print(os.environ.get('OMP_WAIT_POLICY', '-'))"


def _policy(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("code", "env", "policy"),
    [
        ("import hpsray.actors; " + SHOW, {}, "PASSIVE"),
        ("import hpsray.actors; " + SHOW, {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        ("import torch, hpsray.actors; " + SHOW, {}, "-"),
        ("import hpsray.reference; " + SHOW, {}, "-"),
    ],
)
def test_actor_processes_let_idle_openmp_threads_sleep(code, env, policy):
    assert _policy(code, **env) == policy
