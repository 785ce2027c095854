"""Hosts of our own for the tests: Linux network namespaces with one Ray node each.

``hosts`` is one cluster of three namespace hosts (10.77.0.1-3, the head's dashboard on
10.77.0.1:8265) shared by the tests under tests/hosts that a process runs one after another,
torn down by the PIDs inside the namespaces (hpsray.cluster.netns) as soon as the next test to
run does not use it: idle, its three Ray nodes and dashboard would take CPU from every test
after it (about 0.07 of a core, some 125 CPU seconds of a CI run). Skipped, with the reason, where
namespaces cannot be made.
Nothing here sets GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME: the hosts' environment drops them.
"""

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

DRIVERS = Path(__file__).with_name("drivers.py")


class _Shared:
    """This process's namespace hosts while the tests in a row need them: ``cluster``, or the
    ``skip`` reason they cannot be made for."""

    stack: contextlib.ExitStack | None = None
    cluster = None
    skip: str | None = None


@pytest.fixture
def hosts():
    from hpsray.cluster.netns import NetnsHosts, unavailable
    from hpsray.errors import NetnsUnavailable

    if _Shared.cluster is None and _Shared.skip is None:
        _Shared.skip = unavailable() or None
        if _Shared.skip is None:
            stack = contextlib.ExitStack()
            try:
                _Shared.cluster = stack.enter_context(NetnsHosts(3, dashboard=True))
                _Shared.stack = stack
            except NetnsUnavailable as exc:
                _Shared.skip = str(exc)
    if _Shared.cluster is None:
        pytest.skip(f"namespace hosts cannot be made here: {_Shared.skip}")
    return _Shared.cluster


def _release() -> None:
    stack, _Shared.stack, _Shared.cluster = _Shared.stack, None, None
    if stack is not None:
        stack.close()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Tear the hosts down when the next test this process runs (xdist hands a worker its next
    test before it runs this one) does not use them; a later test makes them again."""
    if nextitem is None or "hosts" not in nextitem.fixturenames:
        _release()


def pytest_sessionfinish(session):
    _release()


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
