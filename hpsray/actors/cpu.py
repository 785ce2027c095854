"""How a node's stages share its cores (docs/architecture.md: The trainer's cores).

The train stage is the one the others feed, so on a node where every stage wants the CPU at
once the read, pull and load actors can run ``TrainerSettings.stage_niceness`` steps nicer than the
trainer: the scheduler then gives the trainer's threads the larger share (at 4 steps about
2.4 : 1) while any stage may use a core the others leave idle. With ``TrainerSettings.stage_idle``
their threads run under ``SCHED_IDLE`` instead: a core only where nothing else wants it, never
preempting the trainer's threads (nor anything else of the machine's). Neither needs privilege.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["idle", "idle_threads", "nicer", "thread_niceness", "yield_cores"]


def nicer(steps: int) -> None:
    """Make every thread of this process ``steps`` nicer (at most 19): on Linux niceness is a
    thread's, and the threads a stage started before (numba's, torch's, its I/O threads) keep
    theirs unless each is changed; threads started later inherit it."""
    _each_thread(
        lambda tid: os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    )


def idle() -> None:
    """Run every thread of this process under ``SCHED_IDLE`` (Linux; elsewhere nothing
    changes): it gets a core only when no other thread wants it. Threads started later inherit it."""
    if hasattr(os, "SCHED_IDLE"):
        _each_thread(lambda tid: os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0)))


def idle_threads() -> list[bool]:
    """Whether each thread of this process runs under ``SCHED_IDLE``."""
    if not hasattr(os, "SCHED_IDLE"):
        return [False] * len(_threads())
    return _each_thread(lambda tid: os.sched_getscheduler(tid) == os.SCHED_IDLE)


def thread_niceness() -> list[int]:
    """The niceness of every thread of this process."""
    return _each_thread(lambda tid: os.getpriority(os.PRIO_PROCESS, tid))


def yield_cores(actor: Any, steps: int, idle_policy: bool = False) -> None:
    """:func:`nicer` by ``steps``, then :func:`idle` if ``idle_policy``, for an actor's
    ``__ray_call__`` (Ray passes the actor instance first)."""
    nicer(steps)
    if idle_policy:
        idle()


def _each_thread(fn: Callable[[int], T]) -> list[T]:
    """``fn(tid)`` for every thread of this process, those that ended meanwhile (or refuse the
    change) left out."""
    out = []
    for tid in _threads():
        try:
            out.append(fn(tid))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: this thread only
        return [0]
