"""Settings read from environment variables (docs/operations.md names each one)."""

from __future__ import annotations

import math
import os

from hpsray.errors import ConfigError

__all__ = ["env_seconds"]


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
