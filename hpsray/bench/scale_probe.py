"""The exchange probe of ``hpsray bench scale --hosts netns``: what a batch's traffic between
two hosts costs, measured apart from training on the link being tried.

Two actors, one on host 0 and one on host 1, move the byte counts the model puts on the link
through the paths a training run uses: one mini-batch's ``round`` is the trainers' collectives
(:class:`~hpsray.cluster.collective.CollectiveGroup`: the sparse all-gather, then the dense
all-reduce) and one ``transfer`` is a batch's rows for one remote owner as a Ray object going
from one host's object store to the other's (a loan, a write-back or a refresh). For each the
probe gives the wall seconds and, when the hosts have cores of their own (``host_cpus``), the
CPU seconds every process of the busier host spent on it (``/proc/stat`` of its cores: Ray's
raylets and the kernel's network work included).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

__all__ = ["probe_exchange", "host_cpu_seconds"]


def host_cpu_seconds(cpus: list[int]) -> float:
    """Busy CPU seconds so far of the cores ``cpus`` (``/proc/stat``: all but idle and iowait)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                v = [int(x) for x in fields]
                busy += sum(v) - v[3] - v[4]
    return busy / os.sysconf("SC_CLK_TCK")


class _Peer:
    """One host's end of the probe."""

    def __init__(self) -> None:
        self.group: Any = None

    def join(self, world: int, rank: int, name: str) -> int:
        from hpsray.cluster.collective import CollectiveGroup

        self.group = CollectiveGroup(world, rank, name)
        return rank

    def rounds(self, dense_bytes: int, sparse_bytes: int, dim: int, count: int) -> float:
        """``count`` mini-batch exchanges (sparse all-gather, dense all-reduce): wall seconds."""
        import torch

        per_row = 8 + 4 * dim
        rows = max(int(sparse_bytes) // per_row, 1)
        keys = np.arange(rows, dtype=np.uint64)
        grads = np.ones((rows, dim), dtype=np.float32)
        dense = torch.ones(max(int(dense_bytes) // 4, 1))
        t0 = time.perf_counter()
        for _ in range(count):
            self.group.allgather_sparse(keys, grads)
            self.group.allreduce_sum(dense)
        return time.perf_counter() - t0

    def rows(self, nbytes: int) -> np.ndarray:
        return np.ones(max(int(nbytes), 1), dtype=np.uint8)

    def take(self, refs: list) -> int:
        import ray

        return int(ray.get(refs[0]).nbytes)

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()


def probe_exchange(
    dense_bytes: float,
    sparse_bytes: float,
    rows_bytes: float,
    dim: int,
    host_cpus: list[list[int]] | None,
    count: int = 20,
) -> dict:
    """The costs of one mini-batch's collectives (``round_s``, ``round_cpu_s``) and of one
    batch's rows of one owner crossing to the other host (``transfer_s``, ``transfer_cpu_s``),
    each the mean over ``count`` after one warm-up; CPU seconds are the busier host's, ``None``
    without ``host_cpus``. Runs on the Ray cluster this process is connected to, on its first two
    nodes (this process on the first)."""
    import ray

    from hpsray.cluster.runtime import alive_nodes, on_node

    nodes = alive_nodes()
    if len(nodes) < 2:
        raise ValueError("the exchange probe needs two Ray nodes")
    peer: Any = ray.remote(num_cpus=0)(_Peer)
    a, b = (peer.options(scheduling_strategy=on_node(n["NodeID"])).remote() for n in nodes[:2])
    name = f"scale-probe-{time.time_ns()}"
    ray.get([a.join.remote(2, 0, name), b.join.remote(2, 1, name)])

    def cpu() -> list[float]:
        return [host_cpu_seconds(c) for c in host_cpus[:2]] if host_cpus else [0.0, 0.0]

    def measured(run: Any) -> tuple[float, float | None]:
        run(1)  # warm-up: connections made, buffers allocated
        c0, t0 = cpu(), time.perf_counter()
        run(count)
        wall, c1 = time.perf_counter() - t0, cpu()
        spent = max(y - x for x, y in zip(c0, c1))
        return wall / count, (spent / count if host_cpus else None)

    def rounds(k: int) -> None:
        ray.get([p.rounds.remote(dense_bytes, sparse_bytes, dim, k) for p in (a, b)])

    def transfers(k: int) -> None:
        for _ in range(k):  # host 1 → host 0 (a loan), then host 0 → host 1 (a write-back)
            ray.get(a.take.remote([b.rows.remote(rows_bytes)]))
            ray.get(b.take.remote([a.rows.remote(rows_bytes)]))

    try:
        round_s, round_cpu = measured(rounds)
        pair_s, pair_cpu = measured(transfers)
    finally:
        ray.get([a.close.remote(), b.close.remote()])
        for p in (a, b):
            ray.kill(p)
    return {
        "round_s": round_s,
        "round_cpu_s": round_cpu,
        "transfer_s": pair_s / 2,
        "transfer_cpu_s": pair_cpu / 2 if pair_cpu is not None else None,
        "dense_bytes": dense_bytes,
        "sparse_bytes": sparse_bytes,
        "rows_bytes": rows_bytes,
        "count": count,
    }
