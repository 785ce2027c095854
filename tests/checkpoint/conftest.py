"""Fixtures of the checkpoint tests: numba warm-up, a small real file system."""

from __future__ import annotations

import os
import subprocess

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
def small_fs(tmp_path):
    """A 1 MiB tmpfs mounted for the test (unmounted after it); skips where mounting is not
    permitted (not root, or no CAP_SYS_ADMIN in a container)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root; the injected-ENOSPC tests cover the logic")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
