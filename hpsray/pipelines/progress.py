"""The progress bar of ``fit()`` and ``hpsray train``: examples done, rate and, when the input's
size is known, ETA (tqdm). Silent when stderr is not a terminal or when turned off."""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["known_examples", "progress_bar"]


def known_examples(source) -> int | None:
    """Examples ``source`` yields in one pass, when cheap to know: generated data's ``rows``, the
    Parquet metadata of file sources; ``None`` for text files (the bar then shows no ETA)."""
    rows = getattr(source, "rows", None)
    if isinstance(rows, int):
        return rows
    schema = getattr(source, "schema", None)
    if getattr(schema, "format", None) != "parquet":
        return None
    try:
        import pyarrow.parquet as pq

        from hpsray.data import list_files

        n = 0
        for split in list_files(source.paths):
            with split.filesystem.open_input_file(split.path) as f:
                n += pq.ParquetFile(f).metadata.num_rows
        return n
    except (OSError, ValueError):
        return None


def progress_bar(total: int | None, enabled: bool = True, desc: str = "hpsray") -> tqdm:
    """A bar counting examples on stderr; disabled (a no-op) unless ``enabled`` and stderr is a terminal."""
    return tqdm(
        total=total,
        disable=not enabled or not sys.stderr.isatty(),
        desc=desc,
        unit=" examples",
        unit_scale=True,
        dynamic_ncols=True,
        leave=True,
        file=sys.stderr,
    )
