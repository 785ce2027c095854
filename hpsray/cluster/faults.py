"""Bounded waits: every wait on another process ends within ``[cluster] fault_timeout_s``
(docs/operations.md: Network faults; issue 34).

A wait that passes the timeout finds out who is missing from Ray's node and actor state and
raises :class:`~hpsray.errors.FaultTimeout` naming the node, the actor and what it waited for.
Before naming nobody, it gives Ray up to :func:`settle_seconds` more to declare a node that
stopped answering dead (a cut link is seen by Ray's health checks, not by a socket), so a lost
node is reported as lost however it was lost.

The driver's waits (:func:`wait_all`, :func:`get`) use the process-wide timeout set by
:func:`configure` (the schedule sets it from the job's ``SyncSettings.fault_timeout_s``, with the
job's nodes to watch); the trainers pass their own to the collectives. :class:`Watchdog` ends a
process whose blocking call outlives every timeout (a collective that ignores its own).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from hpsray.env import env_seconds
from hpsray.errors import FaultTimeout

__all__ = [
    "DEFAULT_FAULT_TIMEOUT_S",
    "Watchdog",
    "configure",
    "expired",
    "fault_timeout",
    "get",
    "settle_seconds",
    "wait_all",
]

DEFAULT_FAULT_TIMEOUT_S = 90.0
"""Above Ray's own detection of a silent node with its defaults (5 failed health checks of up to
10 s each, 3 s apart: about 65 s) and far above a mini-batch's collective."""

_ENV = "HPSRAY_FAULT_TIMEOUT_S"
_state: dict[str, Any] = {"timeout": None, "nodes": []}


def fault_timeout() -> float:
    """This process's fault timeout: :func:`configure`'s, else ``$HPSRAY_FAULT_TIMEOUT_S``, else
    :data:`DEFAULT_FAULT_TIMEOUT_S`."""
    value = _state["timeout"]
    return float(value) if value is not None else env_seconds(_ENV, DEFAULT_FAULT_TIMEOUT_S)


def settle_seconds(timeout_s: float) -> float:
    """How long an expired wait gives Ray to declare a silent node dead: half the timeout, at
    most 30 s (the bound on detecting a lost node is ``fault_timeout_s`` plus this)."""
    return min(timeout_s / 2, 30.0)


def configure(timeout_s: float | None = None, nodes: Sequence[Any] = ()) -> None:
    """Set this process's fault timeout (``None``: the default) and the job's nodes to watch
    (objects with ``index``, ``node_id`` and ``stage_actors()``, as the pipeline's)."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"fault_timeout_s must be > 0, got {timeout_s}")
    _state["timeout"], _state["nodes"] = timeout_s, list(nodes)


def _ray_nodes() -> dict[str, dict]:
    import ray

    return {n["NodeID"]: n for n in ray.nodes()}


def _actor_name(actor: Any) -> str:
    try:
        return str(actor._ray_actor_creation_function_descriptor.class_name)
    except AttributeError:
        return repr(actor)


def _dead_nodes(watched: list, known: dict[str, dict]) -> list[str]:
    """The watched nodes Ray reports dead, with their actors; with no watched nodes, every node
    that died since this process started watching (``known``: node id -> its state then)."""
    now = _ray_nodes()
    out = []
    if watched:
        for node in watched:
            state = now.get(node.node_id)
            if state is None or not state.get("Alive"):
                address = state.get("NodeManagerAddress", "?") if state else "?"
                actors = ", ".join(f"{_actor_name(a)}[node {node.index}]" for a in node.stage_actors())
                out.append(f"node {node.index} (Ray node {node.node_id[:12]}, {address}) is dead in Ray: {actors}")
        return out
    for node_id, state in now.items():
        if not state.get("Alive") and known.get(node_id, {}).get("Alive", True):
            out.append(f"Ray node {node_id[:12]} ({state.get('NodeManagerAddress', '?')}) is dead")
    return out


def _silent_actors(watched: list, probe_s: float = 2.0) -> list[str]:
    """The watched nodes' actors that are dead or do not answer within ``probe_s`` (busy, or
    unreachable)."""
    import ray

    probes = {}
    for node in watched:
        for actor in node.stage_actors():
            try:
                probes[actor.__ray_ready__.remote()] = f"{_actor_name(actor)}[node {node.index}]"
            except Exception:  # noqa: BLE001 - a handle that cannot even submit is gone
                continue
    if not probes:
        return []
    ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=probe_s)
    out = []
    for ref, name in probes.items():
        if ref not in ready:
            out.append(f"{name} does not answer (busy waiting itself, or unreachable)")
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the finding
            out.append(f"{name} is gone ({type(e).__name__})")
    return out


def missing(timeout_s: float, known: dict[str, dict] | None = None) -> list[str]:
    """Who is missing, by Ray's state: the dead nodes of the job (waiting up to
    :func:`settle_seconds` for Ray to declare one dead), else its actors that are gone or do
    not answer. ``known``: Ray's nodes when the wait began (for a process with no watched nodes)."""
    watched = list(_state["nodes"])
    known = known if known is not None else {}
    deadline = time.monotonic() + settle_seconds(timeout_s)
    try:
        while True:
            dead = _dead_nodes(watched, known)
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        return dead or _silent_actors(watched)
    except Exception as e:  # noqa: BLE001 - Ray's state unreadable: say so rather than hang or hide the timeout
        return [f"Ray's node state could not be read ({type(e).__name__}: {e})"]


def expired(waited_for: str, timeout_s: float, known: dict[str, dict] | None = None) -> FaultTimeout:
    """The error of a wait for ``waited_for`` that passed ``timeout_s``, naming who is missing."""
    return FaultTimeout(waited_for, timeout_s, missing(timeout_s, known))


def wait_all(refs: list, waited_for: str = "Ray calls", timeout_s: float | None = None) -> None:
    """Wait until every ref is done, raising the first failure as soon as it is known (a dead
    consumer's error must not wait behind another consumer that may wait for it forever), and
    :class:`FaultTimeout` when none finishes for ``timeout_s`` (``None``: :func:`fault_timeout`)."""
    import ray

    timeout = fault_timeout() if timeout_s is None else timeout_s
    pending = list(dict.fromkeys(refs))  # ray.wait refuses a ref given twice (one object, two inputs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise expired(f"{waited_for} ({len(pending)} of {len(refs)} still running)", timeout)
        ray.get(done)


def get(refs: Any, waited_for: str = "Ray calls", timeout_s: float | None = None) -> Any:
    """``ray.get(refs)`` bounded as :func:`wait_all` is (``refs``: one ref or a list)."""
    import ray

    wait_all(refs if isinstance(refs, list) else [refs], waited_for, timeout_s)
    return ray.get(refs)


class Watchdog:
    """Ends this process when a blocking call it guards outlives ``seconds`` (a collective whose
    own timeout did not fire): the stacks go to stderr and the process exits, so Ray reports the
    actor dead and recovery takes over instead of a silent wait. One daemon thread per watchdog,
    armed and disarmed per call (no thread per call)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._armed: tuple[float, str] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            self._armed = (time.monotonic() + seconds, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name=f"hpsray-watchdog-{self.name}", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() > armed[0]:
                stacks = "".join(
                    f"--- thread {tid}\n{''.join(traceback.format_stack(frame))}"
                    for tid, frame in sys._current_frames().items()
                )
                print(
                    f"hpsray watchdog {self.name}: {armed[1]} outlived its timeout; ending this process\n{stacks}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(70)
