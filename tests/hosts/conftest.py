"""Hosts of our own for the tests: Linux network namespaces with one Ray node each.

``hosts`` is one cluster of three namespace hosts (10.77.0.1-3, the head's dashboard on
10.77.0.1:8265) shared by every test under tests/hosts, torn down by the PIDs inside the
namespaces (hpsray.cluster.netns). Skipped, with the reason, where namespaces cannot be made.
Nothing here sets GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME: the hosts' environment drops them.
"""

import subprocess
import sys
from pathlib import Path

import pytest

DRIVERS = Path(__file__).with_name("drivers.py")


@pytest.fixture(scope="session")
def hosts():
    from hpsray.cluster.netns import NetnsHosts, unavailable
    from hpsray.errors import NetnsUnavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    try:
        with NetnsHosts(3, dashboard=True) as cluster:
            yield cluster
    except NetnsUnavailable as exc:
        pytest.skip(f"namespace hosts cannot be made here: {exc}")


@pytest.fixture
def drive(hosts):
    """Run ``drivers.py NAME ARGS`` inside host 0 (the head); its JSON findings, or the test fails."""
    import json

    def run(*args: str, timeout: float = 300) -> dict:
        out = hosts.run(
            0, [sys.executable, str(DRIVERS), *args], timeout=timeout, env=hosts.env(RAY_ADDRESS=hosts.address)
        )
        assert out.returncode == 0, f"driver {args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


def in_host(hosts, host: int, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python ``code`` inside host ``host``."""
    return hosts.run(host, [sys.executable, "-c", code], timeout=timeout)
