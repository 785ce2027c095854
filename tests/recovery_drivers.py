"""Helpers of the recovery tests: a killer that ends stage actors' processes with SIGKILL at
seeded instants while ``fit()`` runs, and the reference result to compare with."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import ray

from hpsray.checkpoint import Checkpoints

KINDS = ("Reader", "MemPS", "SSDPS", "Trainer")


def committed_batches(directory: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in Checkpoints(directory).committed()]


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


class Killer(threading.Thread):
    """Kills, in turn, each ``(kind, node)`` of ``plan`` once the newest checkpoint reaches its
    batch, after a seeded random delay; records what it killed (kind, node, pid)."""

    def __init__(self, pipeline, checkpoint_dir: Path, plan: list[tuple[str, int, int]], seed: int) -> None:
        super().__init__(daemon=True)
        self.pipeline, self.directory, self.plan = pipeline, checkpoint_dir, plan
        self.rng = random.Random(seed)
        self.killed: list[tuple[str, int, int]] = []
        self.stop = threading.Event()

    def _actor(self, kind: str, node: int):
        nodes = list(self.pipeline._nodes)  # replaced whole during a recovery
        if len(nodes) <= node:
            return None
        return {"Reader": nodes[node].reader, "MemPS": nodes[node].mem, "SSDPS": nodes[node].ssd}.get(
            kind, nodes[node].trainer
        )

    def fit(self) -> dict:
        """Run the pipeline's ``fit()`` with this killer at work; it stops once fit returns or raises."""
        self.start()
        try:
            return self.pipeline.fit(progress=False)
        finally:
            self.stop.set()
            self.join()

    def run(self) -> None:
        plan = list(self.plan)
        while plan and not self.stop.is_set():
            kind, node, after_batch = plan[0]
            recovered = len(self.killed)
            if (
                len(self.pipeline.recovery) < recovered
                or max(committed_batches(self.directory), default=-1) < after_batch
            ):
                time.sleep(0.05)  # the last kill's recovery is not done, or training not far enough
                continue
            actor = self._actor(kind, node)
            if actor is None:
                time.sleep(0.05)
                continue
            try:
                pid = pid_of(actor)
                time.sleep(self.rng.uniform(0.0, 0.4))
                if len(self.pipeline.recovery) != recovered:
                    continue  # a recovery (from another cause) replaced it meanwhile: ask again
                os.kill(pid, signal.SIGKILL)
            except Exception:  # noqa: BLE001,S112 - it died meanwhile (a recovery is replacing it): again
                continue
            self.killed.append((kind, node, pid))
            plan.pop(0)


def kill_plan(seed: int, nodes: int, batches: int, kills: int = len(KINDS)) -> list[tuple[str, int, int]]:
    """Every actor kind once (then seeded host-side kinds up to ``kills``: a trainer's restart
    costs a process start with torch and numba, seconds), in a seeded order, each on a seeded
    node, after seeded batches."""
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS[:3]) for _ in range(kills - len(KINDS))]
    rng.shuffle(kinds)
    # the last kill lands by two thirds of the pass: after it the pipeline must still be training
    # when the killer's turn comes (a faster pipeline once finished first, and the kill never came)
    spread = sorted(rng.sample(range(2, min(batches - 6, 2 * batches // 3)), len(kinds)))
    return [(kind, rng.randrange(nodes), at) for kind, at in zip(kinds, spread)]
