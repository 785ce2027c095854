"""Shared fixtures: one local Ray instance for every test that needs it; and collection that gets
by without the optional test dependencies (a GPU machine without Ray, hypothesis or xdist)."""

import importlib.util
import os
import re

import numpy as np
import pytest
from duration_order import DurationOrder  # tests/duration_order.py (this directory is on sys.path)

if not hasattr(np, "row_stack"):  # numpy 2.5 dropped it; numba-cuda's array overloads still name it
    np.row_stack = np.vstack

OPTIONAL = ("ray", "hypothesis", "xdist", "rocksdict", "moto", "aiohttp", "orjson", "requests", "kvikio", "cupy")
"""Packages a test module or conftest may need that a machine may lack: a module (or directory)
that fails to import for want of one of them is reported skipped, with the reason, not an error."""
_MISSING = re.compile(r"No module named '([\w.]+)'")

# Ray shows repeated log lines of its workers once, with a count; the tests want every line.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The test S3 server's dummy credentials, set before any Ray starts, so that the workers of a
# session's Ray (which upload checkpoints from their nodes) sign their uploads as a real node does.
_S3_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
for _name, _value in _S3_TEST_CREDENTIALS.items():
    os.environ.setdefault(_name, _value)


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="write each test file's seconds into tests/durations.json (the order files run in)",
    )


def pytest_configure(config):
    """Register :class:`_OptionalCollect` and :class:`duration_order.DurationOrder`; and, before
    the xdist workers start their Ray instances, make Ray's default auth token once.

    Each ``ray.init`` of a new local instance writes ``~/.ray/auth_token`` when it is missing; two
    workers doing that at once on a fresh machine could leave one cluster with a token the file
    no longer holds.
    """
    config.pluginmanager.register(_OptionalCollect(), "hpsray-optional-collect")
    config.pluginmanager.register(DurationOrder(config.getoption("store_durations")), "hpsray-duration-order")
    if hasattr(config, "workerinput") or os.environ.get("RAY_AUTH_TOKEN"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            _get_default_token_path,
            generate_and_save_token,
        )
    except ImportError:  # a Ray without token authentication
        return
    if not _get_default_token_path().exists():
        generate_and_save_token()


def pytest_terminal_summary(terminalreporter):
    """Figures a test recorded as ``("figure", (name, seconds, note))`` user properties (the
    network chaos trials' times to their outcome), one line per name: trials and the worst.
    They travel with the test reports, so xdist workers' figures reach this summary too."""
    figures: dict[str, list[tuple[float, str]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "figure" and getattr(report, "when", "call") == "call":
                    name, seconds, note = value
                    figures.setdefault(name, []).append((float(seconds), str(note)))
    if figures:
        terminalreporter.section("figures")
        for name, runs in sorted(figures.items()):
            worst = max(runs)
            terminalreporter.write_line(f"{name}: {len(runs)} trial(s), worst {worst[0]:.1f} s ({worst[1]})")


def _absent_optional(name: str) -> str | None:
    """``name``'s top-level package if it is an optional one that is really absent here."""
    top = name.split(".", 1)[0]
    if top not in OPTIONAL:
        return None
    try:
        absent = importlib.util.find_spec(top) is None
    except (ImportError, ValueError):  # blocked, or a half-imported package
        absent = True
    return top if absent else None


def _missing_optional(text: str) -> str | None:
    """The optional package a collection error's text says is missing, if it really is absent here."""
    for name in _MISSING.findall(text):
        if (top := _absent_optional(name)) is not None:
            return top
    return None


class _OptionalCollect:
    """A module (or a directory's conftest, or a test) that cannot import an optional package
    absent here is skipped, naming it: ``pytest -m gpu`` runs on a machine without Ray.
    Registered as a plugin of the session (not as this conftest's hook), so it also sees the
    directory whose own conftest failed: pytest leaves conftest hooks out of that report."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            top = _missing_optional(str(report.longrepr))
            if top is not None:
                reason = f"needs {top!r}, which is not installed here"
                longrepr = (str(collector.path), None, reason)
                outcome.force_result(pytest.CollectReport(report.nodeid, "skipped", longrepr, [], report.sections))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """A test (or its fixture) that imports an optional package absent here is skipped, naming it."""
        outcome = yield
        report = outcome.get_result()
        exc = call.excinfo
        if report.failed and exc is not None and exc.errisinstance(ModuleNotFoundError):
            top = _absent_optional(getattr(exc.value, "name", None) or "")
            if top is not None:
                report.outcome = "skipped"
                report.longrepr = (str(item.path), item.location[1], f"needs {top!r}, which is not installed here")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance (started once per session, stopped at the end)."""
    import ray

    started = not ray.is_initialized()
    if started:
        # address="local": a new instance, never a cluster some other process left running
        from hpsray.cluster.runtime import FAST_CONNECT

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=FAST_CONNECT)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` (``"1m"``, ``"192k"``) under the test's directory,
    unmounted after the test, for a real full disk; skips the test where mounting is not
    permitted (not root, or no CAP_SYS_ADMIN in a container)."""
    import subprocess

    mounted = []

    def mount(size: str):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip(f"mounting a {size} tmpfs needs root")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs here: {r.stderr.strip() or r.returncode}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
