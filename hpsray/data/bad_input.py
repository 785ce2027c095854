"""The bad-input policy: reasons, strict/lenient policy, per-reason report (docs/architecture.md: invariant 8).

The error itself is :class:`hpsray.errors.DataError`; this module defines none.

Strict mode raises a :class:`DataError` naming the file, the line (text) or row (Parquet) and
the reason at the first bad row or file. Lenient mode skips the bad row or file, counts it
under its reason in a :class:`BadInputReport` and raises only once the bad fraction passes
``max_bad_fraction``. Nothing is skipped without being counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpsray.errors import DataError, TooMuchBadInput

log = logging.getLogger("hpsray.data")

# Row-level reasons.
WRONG_COLUMN_COUNT = "wrong_column_count"
NON_NUMERIC_DENSE = "non_numeric_dense"
INVALID_LABEL = "invalid_label"
INVALID_CATEGORICAL = "invalid_categorical"
EMPTY_LINE = "empty_line"
# File-level reasons.
UNREADABLE_PATH = "unreadable_path"
EMPTY_FILE = "empty_file"
TRUNCATED_FILE = "truncated_file"
CORRUPT_FILE = "corrupt_file"
MISSING_COLUMN = "missing_column"

ROW_REASONS = (WRONG_COLUMN_COUNT, NON_NUMERIC_DENSE, INVALID_LABEL, INVALID_CATEGORICAL, EMPTY_LINE)
FILE_REASONS = (UNREADABLE_PATH, EMPTY_FILE, TRUNCATED_FILE, CORRUPT_FILE, MISSING_COLUMN)


@dataclass(frozen=True)
class BadInputPolicy:
    """What to do with bad rows and files.

    - ``mode``: ``"strict"`` raises at the first bad row or file; ``"lenient"`` (the default for
      training) skips and counts.
    - ``max_bad_fraction``: lenient mode raises :class:`TooMuchBadInput` once bad rows exceed this
      fraction of all rows seen (checked after ``min_rows`` rows and at the end), or bad files
      exceed it of all files (checked at the end).
    - ``max_examples``: how many bad-input messages the report keeps (and logs) verbatim.
    """

    mode: str = "lenient"
    max_bad_fraction: float = 0.01
    min_rows: int = 10_000
    max_examples: int = 20

    def __post_init__(self) -> None:
        if self.mode not in ("strict", "lenient"):
            raise ValueError(f"bad_input.mode: must be 'strict' or 'lenient', got {self.mode!r}")
        if not 0.0 <= float(self.max_bad_fraction) <= 1.0:
            raise ValueError(f"bad_input.max_bad_fraction: must lie in [0, 1], got {self.max_bad_fraction!r}")
        if int(self.min_rows) < 0:
            raise ValueError(f"bad_input.min_rows: must be >= 0, got {self.min_rows!r}")
        if int(self.max_examples) < 0:
            raise ValueError(f"bad_input.max_examples: must be >= 0, got {self.max_examples!r}")

    @property
    def strict(self) -> bool:
        return self.mode == "strict"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "bad_input") -> BadInputPolicy:
        """Build from a TOML table; unknown keys and wrong types raise ``ValueError`` naming the key."""
        known: dict[str, type | tuple[type, ...]] = {
            "mode": str,
            "max_bad_fraction": (int, float),
            "min_rows": int,
            "max_examples": int,
        }
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(known)})")
            if isinstance(value, bool) or not isinstance(value, known[key]):
                raise ValueError(f"{where}.{key}: wrong type {type(value).__name__}")
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(str(e).replace("bad_input", where, 1)) from None


STRICT = BadInputPolicy(mode="strict")
LENIENT = BadInputPolicy(mode="lenient")


@dataclass
class BadInputReport:
    """Counts of good and bad input, per reason, for one reader (merge them for a run report)."""

    rows_ok: int = 0
    rows_bad: int = 0
    files_ok: int = 0
    files_bad: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def rows_seen(self) -> int:
        return self.rows_ok + self.rows_bad

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_seen if self.rows_seen else 0.0

    def add(self, err: DataError, policy: BadInputPolicy, *, rows: int = 1, file_level: bool = False) -> None:
        """Record one bad row (or ``rows`` rows) or one bad file; strict mode raises ``err``."""
        if policy.strict:
            raise err
        self.counts[err.reason] = self.counts.get(err.reason, 0) + (1 if file_level else rows)
        if file_level:
            self.files_bad += 1
        else:
            self.rows_bad += rows
        if len(self.examples) < policy.max_examples:
            self.examples.append(str(err))
            log.warning("skipping bad input: %s", err)

    def add_rows(self, reason: str, n: int) -> None:
        """Count ``n`` bad rows of one reason whose messages are not kept (lenient bulk path)."""
        if n:
            self.counts[reason] = self.counts.get(reason, 0) + n
            self.rows_bad += n

    def check(self, policy: BadInputPolicy, *, final: bool = False) -> None:
        """Raise :class:`TooMuchBadInput` when lenient mode's bad fraction is exceeded."""
        if (
            (final or self.rows_seen >= policy.min_rows)
            and self.rows_seen
            and self.bad_fraction > policy.max_bad_fraction
        ):
            raise TooMuchBadInput(
                None,
                "too_much_bad_input",
                f"{self.rows_bad} of {self.rows_seen} rows bad ({self.bad_fraction:.2%} > "
                f"max_bad_fraction {policy.max_bad_fraction:.2%}); {self.summary()}",
            )
        files = self.files_ok + self.files_bad
        if final and files and self.files_bad / files > policy.max_bad_fraction:
            raise TooMuchBadInput(
                None,
                "too_much_bad_input",
                f"{self.files_bad} of {files} files bad (> max_bad_fraction "
                f"{policy.max_bad_fraction:.2%}); {self.summary()}",
            )

    def merge(self, other: BadInputReport, max_examples: int = 20) -> BadInputReport:
        """A new report adding ``self`` and ``other`` (e.g. over the readers of a run)."""
        counts = dict(self.counts)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0) + v
        return BadInputReport(
            self.rows_ok + other.rows_ok,
            self.rows_bad + other.rows_bad,
            self.files_ok + other.files_ok,
            self.files_bad + other.files_bad,
            counts,
            (self.examples + other.examples)[:max_examples],
        )

    def summary(self) -> str:
        """One line: rows and files, good and bad, and the count per reason."""
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"
        return (
            f"rows ok={self.rows_ok} bad={self.rows_bad}, files ok={self.files_ok} bad={self.files_bad}; "
            f"bad input by reason: {reasons}"
        )

    def to_dict(self) -> dict:
        return {
            "rows_ok": self.rows_ok,
            "rows_bad": self.rows_bad,
            "files_ok": self.files_ok,
            "files_bad": self.files_bad,
            "bad_fraction": self.bad_fraction,
            "counts": dict(sorted(self.counts.items())),
            "examples": list(self.examples),
        }
