"""Fixtures of the checkpoint tests: numba warm-up, a small real file system, a real S3 server."""

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


@pytest.fixture(scope="module")
def s3_server():
    """``(host, port)`` of a moto S3 server in this process, with dummy credentials."""
    from s3_server import moto_s3  # tests/s3_server.py

    with moto_s3() as server:
        yield server


@pytest.fixture
def s3_uri(s3_server, request):
    host, port = s3_server
    bucket = "b" + request.node.name.replace("_", "-").lower()[:40]
    return f"s3://{bucket}/ckpts?endpoint_override={host}:{port}&scheme=http&allow_bucket_creation=true"
