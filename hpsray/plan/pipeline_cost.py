"""What the stage actors add to each stage's engine time on this machine, fitted once and cached.

The calibration (:mod:`~hpsray.plan.calibrate`) times each stage's engine alone, without Ray:
its ``work`` seconds per batch. In the pipeline a stage takes ``a + k × work`` seconds per batch:

* ``a``: a fixed cost per batch (the actor call, the object store's puts and gets, the stage's
  bookkeeping, the wake-ups of a process that shares its cores with three others);
* ``k`` (at least 1, one for all stages): the stretch of the engine's own time when the four
  stage processes (and the trainer's torch threads) share the node's cores instead of having
  them to themselves.

The node then trains one batch per ``max(slowest stage, sum of the stages / cores) + o``
seconds, ``o`` the driver's and Ray's own share of the cores (the cores term: stages on ``N``
cores are not free); a pass of ``B`` batches also waits once for its first batch to cross every
stage (``sum of the stages / B`` per batch). ``a``, ``k`` and ``o`` come from real pipeline runs of two reference jobs
on this machine (``hpsray.job.probe``): :func:`fit_costs` fits them, :func:`apply_costs`
predicts with them, and :func:`load_costs` / :func:`save_costs` keep them in a per-machine cache
(``$HPSRAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/hpsray``, else ``~/.cache/hpsray``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
from dataclasses import asdict, dataclass
from importlib import metadata

from hpsray.fileio import write_json

__all__ = [
    "STAGE_NAMES",
    "RunPoint",
    "StageCosts",
    "apply_costs",
    "cache_file",
    "fit_costs",
    "load_costs",
    "machine_key",
    "save_costs",
]

STAGE_NAMES = ("read", "pull", "load", "train")
CACHE_NAME = "plan-stage-costs.json"


@dataclass(frozen=True)
class RunPoint:
    """One reference run of ``batches`` batches: each stage's engine seconds per batch (``work``,
    the Ray-free calibration), its busy seconds per batch in the run (``busy``) and the run's
    wall seconds per batch (``per_batch``) on ``cores`` cores."""

    work: dict
    busy: dict
    per_batch: float
    cores: int
    batches: int = 0


@dataclass(frozen=True)
class StageCosts:
    """``fixed_s[stage]`` (``a``, seconds per batch), ``stretch[stage]`` (``k``), ``other_s``
    (``o``, seconds per batch) of this machine (``key``), measured at ``measured_at`` (UTC, ISO)
    with load average ``load`` in ``seconds``."""

    fixed_s: dict
    stretch: dict
    other_s: float
    key: str
    measured_at: str = ""
    load: float = 0.0
    seconds: float = 0.0


def _base(t: dict, cores: int) -> float:
    """Seconds per batch of stages taking ``t`` seconds each, overlapped on ``cores`` cores."""
    return max(max(t.values(), default=0.0), sum(t.values()) / max(cores, 1))


def apply_costs(costs: StageCosts, work: dict, cores: int, batches: int = 0) -> tuple[float, dict, str]:
    """``(seconds per batch, each stage's seconds per batch in the pipeline, bottleneck)`` of
    stages whose engines take ``work`` seconds per batch, in a pass of ``batches`` (0: endless):
    stage ``s`` takes ``fixed_s[s] + stretch[s] × work[s]``; a batch
    ``max(slowest, sum / cores) + other_s + sum / batches`` (the first batch's way through);
    the bottleneck is the slowest stage, or ``"cores"`` when the sum over the cores decides."""
    t = {s: costs.fixed_s.get(s, 0.0) + costs.stretch.get(s, 1.0) * w for s, w in work.items()}
    slowest = max(t, key=lambda s: t[s])
    shared = sum(t.values()) / max(cores, 1)
    fill = sum(t.values()) / batches if batches > 0 else 0.0
    return _base(t, cores) + costs.other_s + fill, t, ("cores" if shared > t[slowest] else slowest)


def fit_costs(points: list[RunPoint], key: str) -> StageCosts:
    """``a`` per stage, ``k`` and ``o`` from reference runs (two or more batch sizes). The stages
    share the same cores, so they share one ``k``: the slope of all stages' busy seconds over all
    their engine seconds through the runs (at least 1; one run: 1); then per stage
    ``a = mean(busy - k × work)`` (at least 0), and ``o`` the mean of what :func:`apply_costs`
    leaves of each run's seconds per batch (at least 0)."""
    if not points:
        raise ValueError("fit_costs: no reference runs")
    xs = [sum(p.work.get(s, 0.0) for s in STAGE_NAMES) for p in points]
    ys = [sum(p.busy.get(s, 0.0) for s in STAGE_NAMES) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 1.0
    k = max(k, 1.0)
    fixed = {
        s: max(sum(p.busy.get(s, 0.0) - k * p.work.get(s, 0.0) for p in points) / len(points), 0.0) for s in STAGE_NAMES
    }
    costs = StageCosts(fixed, dict.fromkeys(STAGE_NAMES, k), 0.0, key)
    left = [p.per_batch - apply_costs(costs, p.work, p.cores, p.batches)[0] for p in points]
    return dataclasses.replace(costs, other_s=max(sum(left) / len(left), 0.0))


def machine_key(cores: int) -> str:
    """What the costs belong to: this host, its cores, Python, Ray and hpsray (a change of
    any of them measures again)."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    return "|".join((socket.gethostname(), str(cores), platform.python_version(), version("ray"), version("hpsray")))


def cache_file() -> str:
    """The cache's path (it need not exist)."""
    root = os.environ.get("HPSRAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hpsray"
    )
    return os.path.join(root, CACHE_NAME)


def load_costs(key: str) -> StageCosts | None:
    """The cached costs of ``key``, or ``None`` (no cache, another machine, an unreadable file)."""
    try:
        with open(cache_file()) as f:
            d = json.load(f)
        costs = StageCosts(**d)
    except (OSError, ValueError, TypeError):
        return None
    return costs if costs.key == key else None


def save_costs(costs: StageCosts) -> str:
    """Write ``costs`` to the cache (atomically); returns its path."""
    path = cache_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, asdict(costs))
    return path
