"""Ray slow to come up (issue 31): the start is tried again within a bound, then refused with
the reason; the package a reader actor unpickles its source from does not import torch."""

import json
import os
import subprocess
import sys
import time

import pytest

from hpsray.cluster.runtime import with_retries
from hpsray.errors import RayStartError


def _raylet_timeout():
    # what ray._private.node.Node raises when the raylet does not register with the GCS in 30 s
    raise Exception(  # noqa: TRY002
        "The current node timed out during startup. This could happen because some of the raylet "
        "failed to startup or the GCS has become overloaded."
    )


def test_a_start_that_fails_twice_is_tried_again_and_succeeds():
    tries, undone = [], []

    def start():
        tries.append(time.monotonic())
        if len(tries) < 3:
            _raylet_timeout()
        return "context"

    assert with_retries(start, "starting a local Ray", 30.0, lambda: undone.append(1), pause_s=0.05) == "context"
    assert len(tries) == 3 and len(undone) == 2
    # the pause doubles: sleeps never end early, so these lower bounds hold on a busy machine too
    assert tries[1] - tries[0] >= 0.05 and tries[2] - tries[1] >= 0.1


def test_a_start_that_keeps_failing_gives_up_within_the_bound_and_says_why():
    t0 = time.monotonic()
    with pytest.raises(RayStartError) as e:
        with_retries(_raylet_timeout, "starting a local Ray", 0.5, pause_s=0.05)
    assert time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert msg.startswith("starting a local Ray did not succeed in ")
    assert "GCS has become overloaded" in msg and "load average" in msg and "HPSRAY_RAY_START_SECONDS" in msg
    assert isinstance(e.value, ConnectionError)  # hpsray train reports it as a failed run, no traceback


def test_wrong_arguments_are_not_retried():
    tries = []

    def start():
        tries.append(1)
        raise ValueError("unknown option")

    with pytest.raises(ValueError, match="unknown option"):
        with_retries(start, "starting a local Ray", 30.0)
    assert tries == [1]


def test_a_reader_process_does_not_import_torch():
    # a reader actor unpickles its source from hpsray.pipelines.sources; the package must not
    # drag the trainer (torch: seconds of import) into that process
    code = "import sys, hpsray.pipelines.sources, hpsray.actors.reader; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_local_ray_started_by_hpsray_tries_its_store_every_100_ms_and_keeps_the_callers_config():
    # Ray's raylet tries its own object store's socket again after 1 s when the first try comes
    # before the store listens (every second start here): connect() asks for 100 ms tries
    code = (
        "import json, ray\n"
        "from hpsray.cluster.runtime import connect\n"
        "assert connect(None, include_dashboard=False, log_to_driver=False,\n"
        "               _system_config={'raylet_client_num_connect_attempts': 150})\n"
        "print(json.dumps(ray._private.worker._global_node._config))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads(out.stdout.strip().splitlines()[-1])
    assert config["raylet_client_connect_timeout_milliseconds"] == 100
    assert config["raylet_client_num_connect_attempts"] == 150  # the caller's value wins
    assert config["worker_niceness"] == 0
