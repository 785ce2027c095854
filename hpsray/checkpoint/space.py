"""A checkpoint the disk refused: finding the refusal behind an error, and the error to raise."""

from __future__ import annotations

import errno
import os

from hpsray.errors import CheckpointFullError
from hpsray.fileio import FULL_ERRNOS, free_bytes

__all__ = ["full_cause", "full_error", "written_bytes"]


def full_cause(error: BaseException) -> OSError | None:
    """The refusal for want of space (an ``OSError`` with ENOSPC, EDQUOT or EFBIG) that is
    ``error`` or that it wraps (``.cause`` as Ray's task errors, ``__cause__``), else ``None``."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__
    return None


def written_bytes(root: str) -> int:
    """Bytes of the files under ``root`` that took new space: hard links (more than one name)
    share their blocks with a store and are not counted."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_nlink == 1:
                total += st.st_size
    return total


def full_error(refusal: OSError, directory: str, batch: int, needed: int, latest: str | None) -> CheckpointFullError:
    """The error for the checkpoint of ``batch`` in ``directory`` that the disk refused after
    ``needed`` bytes had been written (a lower bound of what it needs); call it once the staging
    directory is removed, so that "free" is what a retry can use."""
    code = refusal.errno or errno.ENOSPC
    free = free_bytes(directory)
    kept = f"{latest} stays the latest checkpoint" if latest else "there is no earlier checkpoint"
    return CheckpointFullError(
        code,
        f"checkpoint directory {directory}: no space left for the checkpoint of batch {batch}: it needs "
        f"more than {needed} bytes (written before the disk refused), "
        f"{'an unknown number of' if free is None else free} bytes are free ({os.strerror(code)}); "
        f"the staging directory was removed and {kept}",
        directory=directory,
        needed=needed,
        free=free,
    )
