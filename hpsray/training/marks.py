"""Profiler ranges that name the parts of a batch, and the device-sync check they carry.

Every strategy runs each mini-batch inside :func:`minibatch`, and the work that reads values
back to the host on purpose inside :func:`host_step`: once per batch (borrow and index, the
loss, an exchange plan) and, in the relaxed modes, each mini-batch's publish (the exchange's
payload is numpy). ``tests/training/budget.py`` counts the launching ops and read-backs inside
the mini-batch ranges. Under :func:`syncs_are_errors` (the gpu tests) a CUDA device runs every
mini-batch with ``torch.cuda.set_sync_debug_mode("error")`` except while some host step runs
(threads of one process share the mode: it is on while any thread is in a mini-batch and none
in a host step), so a read-back anywhere else in a mini-batch raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["HOST_STEP", "MINIBATCH", "host_step", "minibatch", "syncs_are_errors"]

MINIBATCH = "hpsray::minibatch"
HOST_STEP = "hpsray::host_step"

_lock = threading.Lock()
_state = {"strict": 0, "inside": 0, "host": 0}


def _set_mode() -> None:
    """Under the lock: the sync debug mode the counts call for."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    want = 2 if _state["strict"] and _state["inside"] and not _state["host"] else 0  # 2: "error"
    if torch.cuda.get_sync_debug_mode() != want:
        torch.cuda.set_sync_debug_mode(want)


@contextmanager
def _counted(what: str) -> Iterator[None]:
    if not _state["strict"]:
        yield
        return
    with _lock:
        _state[what] += 1
        _set_mode()
    try:
        yield
    finally:
        with _lock:
            _state[what] -= 1
            _set_mode()


@contextmanager
def minibatch() -> Iterator[None]:
    """The range of one mini-batch step."""
    with torch.profiler.record_function(MINIBATCH), _counted("inside"):
        yield


@contextmanager
def host_step(what: str) -> Iterator[None]:
    """A stated host step (``what`` names it in the profile)."""
    with torch.profiler.record_function(f"{HOST_STEP}::{what}"), _counted("host"):
        yield


@contextmanager
def syncs_are_errors() -> Iterator[None]:
    """Every mini-batch outside host steps runs with CUDA's sync debug mode ``"error"``."""
    with _lock:
        _state["strict"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["strict"] -= 1
            _set_mode()
