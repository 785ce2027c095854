"""Shared fixtures: one local Ray instance for every test that needs it."""

import os

import pytest

# Ray shows repeated log lines of its workers once, with a count; the tests want every line.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_configure(config):
    """Before the xdist workers start their Ray instances: make Ray's default auth token once.

    Each ``ray.init`` of a new local instance writes ``~/.ray/auth_token`` when it is missing; two
    workers doing that at once on a fresh machine could leave one cluster with a token the file
    no longer holds.
    """
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
