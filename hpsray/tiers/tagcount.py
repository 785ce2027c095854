"""Counts of sorted keys by their top byte: a tagged key's table (:mod:`hpsray.tables`).

The tiers count what they look up, miss and load per top byte without knowing the tables: sorted
keys of one tag are contiguous, so 255 binary searches split them (no pass over the keys). Only
a model of several tables tags its keys; the report reads the first ``len(tables)`` counts then,
and ignores them otherwise (untagged keys' top bytes are the mix's).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["N_TAGS", "by_tag"]

N_TAGS = 256
_STARTS = np.arange(1, N_TAGS, dtype=np.uint64) << np.uint64(56)  # first key of tags 1..255


def by_tag(sorted_keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """``int64[256]``: how many of ``sorted_keys`` (ascending ``uint64``) have each top byte."""
    ends = np.searchsorted(sorted_keys, _STARTS)
    return np.diff(ends, prepend=0, append=sorted_keys.size).astype(np.int64)
