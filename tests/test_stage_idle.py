"""``TrainerSettings.stage_idle`` (hpsray.actors.cpu): every thread of a stage's process, those it
started before and after, runs under ``SCHED_IDLE``; and through the pipeline's own call on a
real actor (``placement._yielding``'s ``yield_cores``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpsray.actors.cpu import idle_threads, yield_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")

CHILD = """
import threading
from hpsray.actors import cpu
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
print(any(cpu.idle_threads()))
cpu.yield_cores(None, 0, True)
after = threading.Thread(target=stop.wait); after.start()
print(cpu.idle_threads())
stop.set()
"""


def test_every_thread_of_the_process_runs_idle_once_asked():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120)
    first, threads = out.stdout.split("\n", 1)
    assert first == "False"  # a fresh process: no thread idle
    flags = eval(threads)  # noqa: S307 - the child's own list of booleans
    assert len(flags) >= 3 and all(flags), flags  # main, the thread before and the one after


def test_the_pipelines_call_makes_an_actors_threads_idle(ray_local):
    import ray

    @ray.remote(num_cpus=0)
    class Stage:
        def ping(self) -> int:
            return os.getpid()

    actor = Stage.remote()
    try:
        assert ray.get(actor.__ray_call__.remote(lambda a: any(idle_threads())), timeout=60) is False
        actor.__ray_call__.remote(yield_cores, 0, True)  # as placement._yielding sends it: not waited for
        flags = ray.get(actor.__ray_call__.remote(lambda a: idle_threads()), timeout=120)
        assert flags and all(flags), flags
        assert not any(idle_threads())  # the caller's own threads are untouched
    finally:
        ray.kill(actor)
