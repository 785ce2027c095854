"""Test-only hooks injected into the pipeline (``SyncSettings.before_minibatch``)."""

from __future__ import annotations

from collections.abc import Callable


def straggler(node: int, seconds: float) -> Callable[[int, int], None]:
    """A ``before_minibatch`` hook: the trainer of ``node`` sleeps ``seconds`` before each
    mini-batch, so the others run ahead of it (SSP tests). A closure, so Ray pickles it by value
    and the trainers' processes need not import this module."""

    def hook(trainer_node: int, clock: int) -> None:
        import time

        if trainer_node == node:
            time.sleep(seconds)

    return hook
