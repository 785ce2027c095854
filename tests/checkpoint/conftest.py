"""Fixtures of the checkpoint tests: numba warm-up, a small real file system."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def ssd_warm(tmp_path_factory):
    """Load SSD-PS's numba kernels once (seconds on a busy machine), so a test times only itself."""
    from hpsray.tiers.ssd import SSDPS

    with SSDPS(tmp_path_factory.mktemp("warm") / "s", 4, rows_per_file=8, background=False) as s:
        k = np.arange(40, dtype=np.uint64)
        s.dump(k, np.zeros((40, 4), np.float32))
        s.dump(k, np.ones((40, 4), np.float32))
        s.compact(full=True)
        s.load(k)
        s.verify()


@pytest.fixture
def small_fs(tmpfs):
    """A 1 MiB tmpfs (tests/conftest.py: ``tmpfs``); the injected-ENOSPC tests cover the logic
    where it cannot be mounted."""
    return tmpfs("1m")
