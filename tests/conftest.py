"""Shared fixtures: one local Ray instance for every test that needs it."""

import os

import pytest

# Ray shows repeated log lines of its workers once, with a count; the tests want every line.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance (started once per session, stopped at the end)."""
    import ray

    started = not ray.is_initialized()
    if started:
        # address="local": a new instance, never a cluster some other process left running
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
