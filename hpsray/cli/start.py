"""The start of a training command: Ray comes up while the driver prepares the rest.

Starting a local Ray takes seconds of waiting for its processes (GCS, raylet, dashboard), and
the driver has seconds of its own work before the first actor starts: importing the pipeline
(torch among it) and, for ``hpsray demo``, writing the data. :func:`connect_alongside` does both
at once. Ray is started from the calling (main) thread, because Ray's processes die with the
thread that started them; the driver's work runs in a helper thread meanwhile.

That work includes :func:`warm_kernels`: numba compiles the engines' kernels on their first call
and keeps the machine code on disk. On a first run every stage actor would compile its own
(mostly the same) kernels at once; compiled here first, while Ray starts, the actors load them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from hpsray.job import JobConfig

T = TypeVar("T")
log = logging.getLogger("hpsray.start")

__all__ = ["RayStarted", "connect_alongside", "import_pipeline", "warm_kernels"]


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


def warm_kernels(job: JobConfig) -> None:
    """Run the stage actors' warm-ups (:mod:`hpsray.tiers.warmup`) for ``job``'s row width and
    tier options in this process, so numba's disk cache holds their kernels before the actors
    start: a second or so when the cache is warm, the first run's compilation when it is not.
    The reader's decoders compile on the job's first rows. Nothing of the job is written; an
    error here (bad input, say) is left for the actors to raise in its place and order."""
    try:
        _warm_kernels(job)
    except Exception as e:  # noqa: BLE001 - the actors warm up again and report it
        log.debug("warming the kernels in the driver failed: %s", e)


def _warm_kernels(job: JobConfig) -> None:
    from hpsray.actors.memps import warm_admission
    from hpsray.job import build
    from hpsray.kernels.distinct import distinct_sorted
    from hpsray.tiers.hbm import HbmPS
    from hpsray.tiers.partition import owner_of
    from hpsray.tiers.warmup import warm_mem_ps, warm_ssd_ps, warm_trainer_step

    config, tiers = job.train_config(), job.tiers
    width, init = config.row_width, config.row_init()
    source = build.source(job)
    rows = source.reader(64) if hasattr(source, "reader") else source.open(64)
    first = next(iter(rows), None)
    if first is not None:
        owner_of(distinct_sorted(first.keys), max(job.cluster.nodes, 1))
        n_slots, n_dense = first.n_slots, first.dense.shape[1]
        if job.pipeline.device == "cpu":
            warm_trainer_step(
                HbmPS(256, width, init, 1, max(job.cluster.nodes, 1), "cpu"), init, width, n_slots, n_dense
            )
    warm_mem_ps(width, init, **dict(tiers.mem))
    warm_ssd_ps(width, **dict(tiers.ssd))
    if tiers.admit_after > 1 or tiers.expire_after_batches is not None:
        warm_admission()


def connect_alongside(address: str | None, quiet: bool, work: Callable[[], T]) -> RayStarted[T]:
    """Join (or start) Ray at ``address`` in this thread while ``work()`` and
    :func:`import_pipeline` run in a helper thread; wait for both.

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
        started = connect(address, logging_level=logging.WARNING if quiet else logging.INFO, log_to_driver=not quiet)
    finally:
        ray_init_s = time.perf_counter() - t0
        helper.join()
    error = outcome.get("error")
    if isinstance(error, BaseException):
        if started:
            ray.shutdown()
        raise error
    return RayStarted(started, ray_init_s, outcome["result"])  # type: ignore[arg-type]
