"""Settings built from another object's fields of the same names (a job section, parsed command
line options), so that a field added to both flows through without a line to copy it."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["same_fields"]


def same_fields(cls: type, source: Any, **values: Any) -> dict[str, Any]:
    """Keyword arguments for the dataclass ``cls``: each of its fields that ``source`` has an
    attribute of the same name for, taken from ``source``, then ``values`` (which win: renamed or
    derived fields)."""
    out = {f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(source, f.name)}
    out.update(values)
    return out
