"""Checkpoints in object storage across namespace hosts (issue 45): an S3 server (moto) on the
hosts' bridge, at a test address of their subnet; a 2-node job checkpoints to it (each node
uploading from its host), loses every node's SSD-PS directory and the checkpoint cache, resumes
from ``s3://`` and ends equal to an uninterrupted run (tests/hosts/s3_resume_driver.py)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STORAGE = "10.77.0.254"  # on the hosts' bridge, in its namespace: a test address, never 0.0.0.0
MOTO = f"""
from moto.server import ThreadedMotoServer
import time
s = ThreadedMotoServer(ip_address="{STORAGE}", port=9000, verbose=False); s.start()
print("serving", flush=True); time.sleep(3600)
"""


@pytest.fixture
def bridge_s3(hosts):
    """A moto S3 server in the bridge's namespace, listening on :data:`STORAGE` only."""
    pytest.importorskip("moto.server")
    added = subprocess.run(
        ["ip", "-n", hosts.switch, "addr", "add", f"{STORAGE}/24", "dev", "br0"], capture_output=True, text=True
    )
    assert added.returncode == 0 or "exists" in added.stderr, added.stderr
    log = hosts.temp / "moto.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", hosts.switch, sys.executable, "-c", MOTO], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.time() + 60
        while "serving" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        yield f"{STORAGE}:9000"
    finally:
        proc.kill()
        proc.wait()


def test_lost_disks_on_two_hosts_resume_from_s3_equal_to_an_uninterrupted_run(hosts, bridge_s3, tmp_path):
    uri = f"s3://test:test@hosts45/ckpts?endpoint_override={bridge_s3}&scheme=http&allow_bucket_creation=true"
    driver = Path(__file__).with_name("s3_resume_driver.py")
    out = hosts.run(
        0,
        [sys.executable, str(driver), uri, str(tmp_path / "ssd"), str(tmp_path / "cache")],
        timeout=540,
        env=hosts.env(RAY_ADDRESS=hosts.address),
    )
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(set(found["ips"])) == 2 and all(ip.startswith("10.77.0.") for ip in found["ips"])
    assert all(found["nodes"][i]["bytes"] > 0 for i in ("0", "1")), found
    print("upload per node and checkpoint [bytes, files, bytes reused]:", json.dumps(found["sent"]))
