"""The plan's stage costs of this machine (:mod:`hpsray.plan.pipeline_cost`): from the cache, or
measured once with the real stage actors.

The measurement runs two reference jobs (the demo's click log, batches of 1,000 and 4,000 examples,
20 batches each) through a real pipeline in one local Ray, beside the Ray-free calibration of
the same jobs, and fits what the actors add (:func:`~hpsray.plan.pipeline_cost.fit_costs`).
It takes about 15 s on an idle 2-core machine (Ray's start, two sets of actors) and runs only
with ``hpsray plan --calibrate``; later plans read the cache. A measurement taken on a busy
machine (:func:`busy_reason`) is used for that plan but not cached: it would slow every later
prediction.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import tempfile
import time

from hpsray.plan.calibrate import node_cores
from hpsray.plan.pipeline_cost import RunPoint, StageCosts, fit_costs, load_costs, machine_key, save_costs

__all__ = ["REFERENCE_BATCHES", "busy_reason", "cached_costs", "stage_costs"]

REFERENCE_BATCHES = (1000, 4000)  # examples per batch of the two reference jobs
BUSY_STRETCH = 3.0  # stages taking more than this many times their engines' seconds: the cores were taken


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def busy_reason(load: float, cores: int, stretch: float) -> str | None:
    """Why a measurement is not the idle machine's, or ``None``: the load average (the larger of
    before and after) above the cores, or the stages' timings spread wide over their engines'
    (the fitted stretch above :data:`BUSY_STRETCH`: other processes held the cores)."""
    if load > cores:
        return f"load average {load:.1f} above the {cores} cores"
    if stretch > BUSY_STRETCH:
        return f"the stages took x{stretch:.1f} their engines' seconds (other processes held the cores)"
    return None


def _point(work_dir: str, batch: int) -> RunPoint:
    from hpsray.job import build
    from hpsray.job.demo import BATCHES, demo_config
    from hpsray.plan import make_plan

    d = os.path.join(work_dir, str(batch))
    os.makedirs(d)
    job = demo_config(d, batch * BATCHES)  # the demo's job: its 20 batches of ``batch`` examples
    plan = make_plan(job, 6 * batch)
    assert plan.stage_s_per_batch is not None and plan.calibration is not None
    with build.pipeline(job) as pipe:
        report = pipe.fit(progress=False)
    n = max(report["batches"], 1)
    return RunPoint(
        work=dict(plan.stage_s_per_batch),
        busy={s: v / n for s, v in report["stage_busy_s"].items()},
        per_batch=report["wall_s"] / n,
        cores=plan.calibration.cores,
        batches=n,
    )


def measure() -> StageCosts:
    """Run the reference jobs now and return the fitted costs (not cached)."""
    import ray

    from hpsray.cluster.runtime import connect

    t0 = time.perf_counter()
    load = _load()
    started = connect(include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="hpsray-plan-probe-") as work:
            points = [_point(work, b) for b in REFERENCE_BATCHES]
    finally:
        if started:
            ray.shutdown()
    costs = fit_costs(points, machine_key(node_cores()))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = max(load, _load())
    return dataclasses.replace(costs, measured_at=when, load=load, seconds=time.perf_counter() - t0)


def cached_costs() -> StageCosts | None:
    """This machine's cached stage costs, or ``None``; starts nothing."""
    return load_costs(machine_key(node_cores()))


def stage_costs(recalibrate: bool = False, quiet: bool = False) -> StageCosts | None:
    """This machine's stage costs: cached (unless ``recalibrate``), else measured now with a
    local Ray (``hpsray plan --calibrate``) and cached unless the machine was busy
    (:func:`busy_reason`: then they serve this plan only, and a line says why they were not
    kept); ``None`` when Ray cannot run the reference jobs (the plan then says its rate is the
    engines' alone)."""
    if not recalibrate:
        cached = cached_costs()
        if cached is not None:
            return cached
    if not quiet:
        print(
            "hpsray plan: timing the stage actors on this machine (two short runs with a local Ray)...", file=sys.stderr
        )
    try:
        costs = measure()
    except Exception as e:  # noqa: BLE001 - the plan still sizes the job; its note says why
        print(f"hpsray plan: cannot time the stage actors ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    busy = busy_reason(costs.load, node_cores(), max(costs.stretch.values(), default=1.0))
    if busy is not None:
        print(
            f"hpsray plan: stage costs NOT cached: the machine was busy ({busy}); they serve this plan only "
            "(run hpsray plan --calibrate again on an idle machine)",
            file=sys.stderr,
        )
        return costs
    path = save_costs(costs)
    if not quiet:
        print(f"hpsray plan: stage costs cached in {path} ({costs.seconds:.1f} s)", file=sys.stderr)
    return costs
