"""Joining Ray: an embedded local instance by default, or an existing cluster.

With no address (and no ``RAY_ADDRESS``) hpsray starts a local Ray. Ray 2.60 then turns on
token authentication and writes ``~/.ray/auth_token``; later ``ray start`` / ``ray job submit``
against such a cluster need ``RAY_AUTH_MODE=token`` (docs/operations.md). :func:`dashboard_hint`
says where the local Ray's dashboard is and, with token authentication on, where its token is.

On a loaded machine Ray can fail to come up (its raylet does not register with the GCS within
Ray's own 30 s, or the GCS does not answer): :func:`connect` then tries again, until
``$HPSRAY_RAY_START_SECONDS`` (default 120) have passed, and gives up with a
:class:`RayStartError` that says why (docs/operations.md: The start).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hpsray.env import env_seconds
from hpsray.errors import RayStartError

log = logging.getLogger("hpsray.cluster")

START_ENV = "HPSRAY_RAY_START_SECONDS"
DEFAULT_START_SECONDS = 120.0

T = TypeVar("T")

# Ray's start races its raylet against the raylet's own object store: the raylet connects to the
# store's socket as soon as it has started the store's thread and, when the socket is not there
# yet, tries again after ``raylet_client_connect_timeout_milliseconds`` (1000 by default): half
# the local starts here took 1 s longer for it. Tries every 100 ms keep Ray's 10 s bound.
FAST_CONNECT = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100}


def start_seconds() -> float:
    """How long :func:`connect` keeps trying: ``$HPSRAY_RAY_START_SECONDS``, else 120."""
    return env_seconds(START_ENV, DEFAULT_START_SECONDS, zero_ok=True)


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} (5 min {five:.1f}) on {os.cpu_count() or 1} cores"


def with_retries(
    start: Callable[[], T], what: str, bound_s: float, undo: Callable[[], None] = lambda: None, pause_s: float = 2.0
) -> T:
    """``start()``, tried again after a failure (``undo()`` first, then a pause doubling from
    ``pause_s``) until ``bound_s`` seconds have passed since the first try; then
    :class:`RayStartError` naming ``what``, the tries, the last error and the machine's load.
    Errors of the arguments (``ValueError``, ``TypeError``) are raised at once."""
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            return start()
        except (ValueError, TypeError):
            raise
        except Exception as e:  # noqa: BLE001 - Ray raises bare Exception when its raylet does not register
            undo()
            elapsed = time.monotonic() - t0
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if elapsed + pause_s > bound_s:
                raise RayStartError(
                    f"{what} did not succeed in {tries} tries over {elapsed:.0f} s (bound {bound_s:.0f} s, "
                    f"${START_ENV}); last error: {why}; {_load()}. A machine this busy starts Ray's processes "
                    "slowly: try again when it is quieter, raise the bound, or join a running cluster "
                    "(--address or RAY_ADDRESS)"
                ) from e
            log.warning("%s failed (%s; %s); trying again in %.0f s", what, why, _load(), pause_s)
            time.sleep(pause_s)
            pause_s *= 2


def connect(address: str | None = None, **init_options: Any) -> bool:
    """Make sure this process is connected to Ray; returns True if it started Ray itself. A
    failed start (or join) is tried again within :func:`start_seconds` (:func:`with_retries`)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    options = {"log_to_driver": True, **init_options}
    _local.clear()
    bound = start_seconds()
    if address:
        with_retries(lambda: ray.init(address=address, **options), f"joining Ray at {address}", bound, ray.shutdown)
    else:
        # Ray starts its workers at niceness 15; the embedded instance exists only for this job,
        # whose trainer must not yield its cores to whatever else runs on the machine
        options["_system_config"] = {"worker_niceness": 0, **FAST_CONNECT, **options.get("_system_config", {})}
        context = with_retries(
            lambda: ray.init(address="local", **options), "starting a local Ray", bound, ray.shutdown
        )
        _local["dashboard_url"] = getattr(context, "dashboard_url", None) or None
    return True


_local: dict = {}  # what connect() learnt of the local Ray it started


def _token_auth_on() -> bool:
    try:  # Ray's own check (reads RAY_AUTH_MODE, which ray.init sets to "token" by default)
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return bool(is_token_auth_enabled())
    except Exception:  # noqa: BLE001 - a Ray without this module: the variable decides
        return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"


def token_location() -> str:
    """Where Ray finds the auth token, as Ray looks: the ``RAY_AUTH_TOKEN`` variable, the file
    ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def dashboard_hint() -> str | None:
    """One line for the user of the local Ray that :func:`connect` started: its dashboard URL
    (there while the job runs) and, when Ray's token authentication is on, where the token the
    dashboard asks for is and the command that prints it. ``None`` without a local dashboard."""
    url = _local.get("dashboard_url")
    if not url:
        return None
    url = url if "://" in url else f"http://{url}"
    line = f"Ray dashboard at {url} while this job runs"
    if _token_auth_on():
        where = token_location()
        what = "the value of $RAY_AUTH_TOKEN" if where.startswith("$") else f"the contents of {where}"
        line += f"; its 'Authentication Token Required' dialog takes {what} (`ray get-auth-token` prints it)"
    return line


def alive_nodes() -> list[dict]:
    """Alive Ray nodes, the driver's own node first, then by node id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeID"]))


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy that pins an actor to one node."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


NODE_RESOURCE = "hpsray_node"


def training_nodes() -> list[dict]:
    """The nodes that may host an hpsray node (MEM-PS, SSD-PS, trainer, readers).

    Nodes offering the custom resource ``hpsray_node`` when the cluster marks any (the cluster
    launcher and KubeRay examples give it to the workers, so a head without disks stays out);
    otherwise every alive node. Order as :func:`alive_nodes`.
    """
    nodes = alive_nodes()
    marked = [n for n in nodes if n.get("Resources", {}).get(NODE_RESOURCE, 0) > 0]
    return marked or nodes
