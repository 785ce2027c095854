"""Capacity planning without Ray (``hpsray plan JOB.toml``; issue 18).

* :mod:`~hpsray.plan.sketch` — a HyperLogLog distinct-key sketch (numba, mergeable);
* :mod:`~hpsray.plan.sample` — the job's first examples through its own readers, and the input's size;
* :mod:`~hpsray.plan.estimate` — distinct keys per batch, pinned at once, and in all (extrapolated);
* :mod:`~hpsray.plan.sizing` — rows and bytes per tier, by the tiers' own formulas;
* :mod:`~hpsray.plan.calibrate` — each stage's engine timed on the sample, the predicted examples/s;
* :mod:`~hpsray.plan.pipeline_cost` — what the stage actors add on this machine (fitted, cached);
* :mod:`~hpsray.plan.plan` — :class:`Plan`, :func:`make_plan`, :func:`check_plan` (the fix to set);
* :mod:`~hpsray.plan.render` — the plan as text.
"""

from hpsray.plan.plan import DEFAULT_SAMPLE_ROWS, Plan, Problem, check_plan, make_plan
from hpsray.plan.render import render
from hpsray.plan.sketch import DistinctSketch

__all__ = ["DEFAULT_SAMPLE_ROWS", "DistinctSketch", "Plan", "Problem", "check_plan", "make_plan", "render"]
