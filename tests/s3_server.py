"""A real S3 server for tests (moto's server mode, threaded, in this process), with dummy
credentials in the environment: processes started while it runs (Ray nodes, their workers)
inherit them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_s3(ip_address: str = "127.0.0.1") -> Iterator[tuple[str, int]]:
    """``(host, port)`` of a moto S3 server listening on ``ip_address`` (a test address only)."""
    moto_server = pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        mp.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address=ip_address, port=0, verbose=False)
    server.start()
    try:
        yield server.get_host_and_port()
    finally:
        server.stop()
        mp.undo()


def s3_uri(host: str, port: int, bucket: str) -> str:
    """A checkpoint URI under ``bucket`` of the server; the bucket is created here."""
    import pyarrow.fs as pafs

    uri = f"s3://{bucket}/ckpts?endpoint_override={host}:{port}&scheme=http&allow_bucket_creation=true"
    fs, path = pafs.FileSystem.from_uri(uri)
    fs.create_dir(path.split("/")[0])
    return uri
