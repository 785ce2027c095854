"""The Ray dashboard's REST API lists the named stage actors of a pipeline run (issue 18), and
the local Ray hpsray starts tells where its dashboard and auth token are.

One module-scoped local Ray with its dashboard, started by hpsray's own ``connect`` (as
``hpsray train`` / ``hpsray demo`` start it); the session's dashboard-less Ray, when running,
is stopped for this module and started again after it.
"""

import socket

import pytest
import requests

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.pipelines import SyntheticSource

from small_pipeline import small_pipeline  # tests/small_pipeline.py

STAGES = ("Reader", "MemPS", "SSDPS", "Trainer")
# its own Ray with the dashboard (about 10 s idle) and a pipeline's actors (their processes and
# warm-ups): about 25 s on an idle 2-core machine, 50 s and more when it is loaded
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard():
    """``(base URL, auth headers)`` of a local Ray with its dashboard, after a short pipeline run
    named ``dash`` whose actors are still alive."""
    import ray

    from hpsray.cluster.runtime import connect, dashboard_hint

    had_ray = ray.is_initialized()
    if had_ray:
        ray.shutdown()
    port = _free_port()
    assert connect(None, num_cpus=2, include_dashboard=True, dashboard_port=port, log_to_driver=False)
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

        headers = get_auth_headers_if_auth_enabled({})
        data = PlantedCTR(n_slots=2, keys_per_slot=500, n_dense=1, seed=0)
        config = TrainConfig(dim=4, hidden=(4,), minibatch_size=500)
        with small_pipeline(
            SyntheticSource(data, rows=2000), config, mem_rows=1000, batch_size=1000, name="dash"
        ) as pipe:
            pipe.fit(progress=False)
            yield f"http://127.0.0.1:{port}", headers, dashboard_hint()
    finally:
        ray.shutdown()
        if had_ray:  # as tests/conftest.py's ray_local started it
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


def test_the_rest_api_lists_the_named_stage_actors(dashboard):
    url, headers, _ = dashboard
    r = requests.get(f"{url}/api/v0/actors", params={"detail": "1", "limit": "1000"}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text[:300]
    actors = {a["name"]: a for a in r.json()["data"]["result"]["result"] if a.get("name")}
    for stage in STAGES:
        a = actors.get(f"dash:{stage}[node 0]")
        assert a is not None, (stage, sorted(actors))
        assert a["state"] == "ALIVE" and a["repr_name"].startswith(f"{stage}[node 0"), a  # Reader[node 0, #0]


def test_token_auth_and_the_hint_that_gets_past_it(dashboard):
    url, headers, hint = dashboard
    mode = requests.get(f"{url}/api/authentication_mode", timeout=30).json()["authentication_mode"]
    assert hint is not None and f"Ray dashboard at {url}" in hint, hint
    if mode != "token":
        assert "auth token" not in hint
        pytest.skip(f"Ray's token authentication is {mode} here (RAY_AUTH_MODE)")
    # without the token the API refuses, as the dashboard's 'Authentication Token Required' dialog does
    assert requests.get(f"{url}/api/v0/actors", timeout=30).status_code == 401
    assert headers["authorization"].startswith("Bearer ")
    assert "ray get-auth-token" in hint and ("auth_token" in hint or "RAY_AUTH_TOKEN" in hint), hint
