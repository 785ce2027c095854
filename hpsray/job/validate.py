"""Reading one TOML table with checks: :class:`Table` takes each key once (leftovers are unknown
keys) and turns a checker's :class:`_Rejected` into a :class:`~hpsray.errors.ConfigError` naming file and
dotted key. The checkers (``integer``, ``number``, ``choice``, ``size``, ...) return the value.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from hpsray.errors import ConfigError, PrivateControlFlow

__all__ = [
    "UNSET",
    "Table",
    "boolean",
    "choice",
    "hidden",
    "integer",
    "is_uri",
    "number",
    "parse_sub",
    "paths",
    "resolve_path",
    "size",
    "slot_list",
    "string",
    "string_list",
    "type_name",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class Table:
    """One TOML table being read: each key is taken once; leftovers are unknown keys."""

    def __init__(self, d: Any, prefix: str, where: str) -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(d, Mapping):
            self.fail("", f"must be a table, got {type_name(d)}")
        self.d = dict(d)
        self.known: list[str] = []

    def key(self, k: str) -> str:
        return f"{self.prefix}.{k}" if self.prefix else k

    def fail(self, k: str, reason: str) -> NoReturn:
        raise ConfigError(self.where, self.key(k) if k else self.prefix, reason)

    def take(self, k: str, check: Callable[[Any], Any] | None, default: Any = None, required: bool = False) -> Any:
        self.known.append(k)
        if k not in self.d:
            if required:
                self.fail(k, "missing (required)")
            return default
        v = self.d.pop(k)
        if check is None:
            return v
        try:
            return check(v)
        except _Rejected as e:
            self.fail(k, str(e))

    def sub(self, k: str) -> Table | None:
        self.known.append(k)
        if k not in self.d:
            return None
        return Table(self.d.pop(k), self.key(k), self.where)

    def done(self) -> None:
        for k in self.d:
            close = difflib.get_close_matches(str(k), self.known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            self.fail(k, f"unknown key ({hint}known: {', '.join(self.known)})")


UNSET = object()  # a key the table leaves out (None may be a real value)


class _Rejected(PrivateControlFlow):
    """A value's reason for rejection, raised by the checkers below and caught by
    :meth:`Table.take`, which raises :class:`~hpsray.errors.ConfigError` naming file and key."""


def type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(v), type(v).__name__
    )


def integer(lo: int) -> Callable[[Any], int]:
    what = "a positive integer" if lo == 1 else "a non-negative integer" if lo == 0 else f"an integer >= {lo}"

    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise _Rejected(f"must be {what}, got {v!r}")
        return v

    return check


def number(
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    optional: bool = False,
) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        if optional and v is False:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise _Rejected(f"must be a number{' or false' if optional else ''}, got {v!r}")
        bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            lb = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
            ub = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
            rng = (
                f"in {lb}, {ub}"
                if lo is not None and hi is not None
                else (f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else f"{'<' if hi_open else '<='} {hi:g}")
            )
            raise _Rejected(f"must be {rng}, got {v!r}")
        return float(v)

    return check


def choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in options:
            raise _Rejected(f"must be one of {', '.join(options)}, got {v!r}")
        return v.lower()

    return check


def string(v: Any) -> str:
    if not isinstance(v, str):
        raise _Rejected(f"must be a string, got {type_name(v)} {v!r}")
    return v


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Rejected(f"must be true or false, got {v!r}")
    return v


def size(v: Any) -> int:
    """Bytes: an integer or a string such as ``"512 MiB"``."""
    if isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            raise _Rejected(f'must be a byte count such as 1073741824 or "1 GiB", got {v!r}')
        v = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _Rejected(f"must be a positive byte count, got {v!r}")
    return v


def paths(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
        raise _Rejected(f"must be a path or a non-empty array of paths, got {v!r}")
    return tuple(v)


def hidden(v: Any) -> tuple[int, ...]:
    if (
        isinstance(v, bool)
        or not isinstance(v, list)
        or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in v)
    ):
        raise _Rejected(f"must be an array of positive integers (MLP widths), got {v!r}")
    return tuple(v)


def slot_list(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        raise _Rejected(f"must be a non-empty array of slot numbers, got {v!r}")
    return tuple(v)


def string_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        raise _Rejected(f"must be a non-empty array of names, got {v!r}")
    return tuple(v)


def is_uri(p: str) -> bool:
    return "://" in p


def resolve_path(p: str, base: str) -> str:
    """A path from the job file, relative to the file's directory (URIs are left alone)."""
    if is_uri(p):
        return p
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base, p))


def parse_sub(t: Table, parse: Callable[..., Any], sub: Table, where: str) -> Any:
    """``parse(sub.d, where=where)``, its ``ValueError`` re-raised as a ``ConfigError`` of ``t``."""
    try:
        return parse(sub.d, where=where)
    except ValueError as e:
        raise ConfigError(t.where, "", with_suggestion(str(e))) from None


_UNKNOWN = re.compile(r"^(?P<key>[\w.\-]+): unknown key \(known: (?P<known>[^)]*)\)")


def with_suggestion(message: str) -> str:
    """An ``"<table>.<key>: unknown key (known: a, b)"`` message with ``did you mean 'a'?`` added
    when one known key is close to the unknown one (difflib); other messages unchanged."""
    m = _UNKNOWN.match(message)
    if m is None:
        return message
    known = [k.strip() for k in m.group("known").split(",")]
    close = difflib.get_close_matches(m.group("key").rsplit(".", 1)[-1], known, n=1, cutoff=0.6)
    if not close:
        return message
    return message.replace("unknown key (", f"unknown key (did you mean {close[0]!r}? ", 1)
