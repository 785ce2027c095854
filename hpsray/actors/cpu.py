"""How a node's stages share its cores (docs/architecture.md: The trainer's cores).

The train stage is the one the others feed, so on a node where every stage wants the CPU at
once the read, pull and load actors can run ``TrainerSettings.stage_niceness`` steps nicer than the
trainer: the scheduler then gives the trainer's threads the larger share (at 4 steps about
2.4 : 1) while any stage may use a core the others leave idle. Raising one's niceness needs
no privilege.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["nicer", "thread_niceness", "yield_cores"]


def nicer(steps: int) -> None:
    """Make every thread of this process ``steps`` nicer (at most 19): on Linux niceness is a
    thread's, and the threads a stage started before (numba's, torch's, its I/O threads) keep
    theirs unless each is changed; threads started later inherit it."""
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue


def thread_niceness() -> list[int]:
    """The niceness of every thread of this process."""
    out = []
    for tid in _threads():
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            continue
    return out


def yield_cores(actor: Any, steps: int) -> None:
    """:func:`nicer` for an actor's ``__ray_call__`` (Ray passes the actor instance first)."""
    nicer(steps)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: this thread only
        return [0]
