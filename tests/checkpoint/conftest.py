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
    moto_server = pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        mp.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield server.get_host_and_port()
    finally:
        server.stop()
        mp.undo()


@pytest.fixture
def s3_uri(s3_server, request):
    host, port = s3_server
    bucket = "b" + request.node.name.replace("_", "-").lower()[:40]
    return f"s3://{bucket}/ckpts?endpoint_override={host}:{port}&scheme=http&allow_bucket_creation=true"
