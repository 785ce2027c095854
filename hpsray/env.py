"""Settings read from environment variables (docs/operations.md names each one)."""

from __future__ import annotations

import math
import os
import sys

from hpsray.errors import ConfigError

__all__ = ["env_seconds", "omp_threads_sleep"]


def env_seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """``$name`` as a number of seconds: ``default`` when unset or blank, else a finite number
    above 0 (``zero_ok``: 0 or above). Anything else raises :class:`~hpsray.errors.ConfigError`
    (a ``ValueError``) naming the variable and its value."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError("environment", name, f"must be a finite number of seconds {bound}, got {raw!r}")
    return value


def omp_threads_sleep() -> bool:
    """Let idle OpenMP threads (torch's intra-op pool, numba's parallel loops) sleep between
    parallel regions (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning, where no OpenMP runtime
    of this process has started yet (else it read the policy already); a value the user set wins.
    Returns whether the process's threads will sleep."""
    if "torch" not in sys.modules and "numba.np.ufunc.omppool" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
