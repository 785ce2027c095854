"""A byte range of one input file: what a reader reads and a format splits files into
(:mod:`hpsray.data.sources` lists and cuts the files)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

__all__ = ["Split"]


@dataclass(frozen=True)
class Split:
    """Bytes ``[start, end)`` of one file (``end=None``: to the end of the file).

    ``uri`` names the file in messages; ``path`` is its path inside ``filesystem``. ``size`` is
    ``None`` when the file could not be listed (reading it reports ``unreadable_path``).
    """

    uri: str
    path: str
    filesystem: pafs.FileSystem
    start: int = 0
    end: int | None = None
    size: int | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and (self.end is None or (self.size is not None and self.end >= self.size))

    @property
    def nbytes(self) -> int:
        if self.size is None:
            return 0
        return (self.size if self.end is None else self.end) - self.start

    def __repr__(self) -> str:
        rng = "" if self.whole else f"[{self.start}:{self.end}]"
        return f"Split({self.uri}{rng})"
