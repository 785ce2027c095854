"""Namespace hosts with cores of their own (hpsray/cluster/netns.py, ``pin=True``): every process a
host starts, and its children, run on the host's cpuset only; a busy loop stays there. No Ray
cluster is started (``start_ray=False``): a second or two."""

from __future__ import annotations

import os
import sys
import time

import pytest

from hpsray.cluster.netns import CPUSET_ROOT, NetnsHosts, host_cpus, unavailable

CHILD = (
    "import subprocess; print(subprocess.run(['grep', 'Cpus_allowed_list', '/proc/self/status'], "
    "capture_output=True, text=True).stdout)"
)


def allowed(text: str) -> set[int]:
    """Cores of a ``Cpus_allowed_list`` line (``0-1,3``)."""
    cores: set[int] = set()
    for part in text.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return cores


def test_host_cpus_gives_each_host_its_own_cores_and_wraps_round():
    assert host_cpus(2, 1, [0, 1]) == [[0], [1]]
    assert host_cpus(2, 2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert host_cpus(3, 1, [0, 1]) == [[0], [1], [0]]  # more hosts than cores: shared
    with pytest.raises(ValueError, match="cpus per host must be >= 1"):
        host_cpus(2, 0)


def test_pinned_hosts_run_their_processes_and_children_on_their_own_cores():
    reason = unavailable()
    if reason:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    cores = sorted(os.sched_getaffinity(0))
    n = 2 if len(cores) >= 2 else 1
    with NetnsHosts(n, cpus_per_host=1, pin=True, start_ray=False, tag=f"hpc{os.getpid()}") as hosts:
        assert hosts.pinning in ("cpuset", "taskset") and hosts.cpus == [[c] for c in cores[:n]]
        if hosts.pinning == "cpuset":
            assert (CPUSET_ROOT / f"hpc{os.getpid()}-h0" / "cpuset.cpus").read_text().strip() == str(cores[0])
        for i in range(n):
            out = hosts.run(i, [sys.executable, "-c", CHILD], timeout=60)  # a child of the host's process
            assert out.returncode == 0, out.stderr
            assert allowed(out.stdout) == {cores[i]}
        (loop,) = hosts.busy(n - 1)
        try:
            deadline = time.monotonic() + 30
            while loop.pid not in hosts.pids(n - 1):  # sh, then `ip netns exec`, then python: one pid
                assert time.monotonic() < deadline and loop.poll() is None
                time.sleep(0.05)
            status = open(f"/proc/{loop.pid}/status").read()
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
            assert allowed(line) == {cores[n - 1]}
        finally:
            loop.kill()
            loop.wait()
    assert not any(p.name.startswith(f"hpc{os.getpid()}-") for p in CPUSET_ROOT.iterdir())  # removed
