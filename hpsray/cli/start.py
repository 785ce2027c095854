"""The start of a training command: Ray comes up while the driver prepares the rest.

Starting a local Ray takes seconds of waiting for its processes (GCS, raylet, dashboard), and
the driver has seconds of its own work before the first actor starts: importing the pipeline
(torch among it) and, for ``hpsray demo``, writing the data. :func:`connect_alongside` does both
at once. Ray is started from the calling (main) thread, because Ray's processes die with the
thread that started them; the driver's work runs in a helper thread meanwhile.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["RayStarted", "connect_alongside", "import_pipeline", "tidy_ray_logs"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Ray's loggers whose records a command's log shows: the driver's (the dashboard line, in colour)
# and Serve's; the token-authentication one says what hpsray's own dashboard line says better
RAY_LOGGERS = ("ray._private.worker", "ray.serve", "ray._private.authentication.authentication_token_setup")
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _TidyRayLogs(logging.Filter):
    """Drops Ray's notice that a local cluster turned token authentication on (nothing for the
    user to do: hpsray prints where the token is, ``dashboard_hint``); with ``plain``, takes the
    colour codes out of the others."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.plain = plain

    def filter(self, record: logging.LogRecord) -> bool:
        if TOKEN_NOTICE in str(record.msg):
            return False
        if self.plain:
            record.msg, record.args = _ANSI.sub("", record.getMessage()), None
        return True


def tidy_ray_logs(stream: object = None) -> None:
    """Before Ray starts in a command: when ``stream`` (default stderr) is not a terminal, no
    colour codes in Ray's lines (``RAY_COLOR_PREFIX=0`` for the workers' lines the driver prints,
    unless the environment sets it; a filter on Ray's driver loggers), and never Ray's
    token-authentication notice. Imports no Ray; idempotent."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    plain = not (callable(isatty) and isatty())
    if plain:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for name in RAY_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _TidyRayLogs)]:
            logger.removeFilter(f)
        logger.addFilter(_TidyRayLogs(plain))


@dataclass(frozen=True)
class RayStarted(Generic[T]):
    """What :func:`connect_alongside` did: ``started`` whether this process started Ray (and so
    stops it), ``ray_init_s`` the seconds Ray took to come up (the report's ``start.ray_init_s``),
    ``result`` what the work returned."""

    started: bool
    ray_init_s: float
    result: T


def import_pipeline() -> None:
    """Import what the driver needs to build and run a pipeline (the trainer's torch included)."""
    import hpsray.export  # noqa: F401
    import hpsray.job.build  # noqa: F401
    import hpsray.pipelines.pipeline  # noqa: F401


def connect_alongside(address: str | None, quiet: bool, work: Callable[[], T], dashboard: bool = True) -> RayStarted[T]:
    """Join (or start) Ray at ``address`` in this thread while ``work()`` and
    :func:`import_pipeline` run in a helper thread; wait for both. ``dashboard``: whether a
    local Ray this call starts runs its dashboard (``ray.init`` waits for it: ~1.5 s more).

    An error of either is raised after both have ended, the work's first; a Ray this call
    started is stopped again when the work failed.
    """
    import ray

    from hpsray.cluster.runtime import connect

    outcome: dict[str, object] = {}

    def meanwhile() -> None:
        try:
            import_pipeline()
            outcome["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread below
            outcome["error"] = e

    helper = threading.Thread(target=meanwhile, name="hpsray-start", daemon=True)
    helper.start()
    t0 = time.perf_counter()
    try:
        options = {} if dashboard else {"include_dashboard": False}
        level = logging.WARNING if quiet else logging.INFO
        started = connect(address, logging_level=level, log_to_driver=not quiet, **options)
    finally:
        ray_init_s = time.perf_counter() - t0
        helper.join()
    error = outcome.get("error")
    if isinstance(error, BaseException):
        if started:
            ray.shutdown()
        raise error
    return RayStarted(started, ray_init_s, outcome["result"])  # type: ignore[arg-type]
