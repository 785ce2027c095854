"""The load stage's actor runs MEM-PS's writes on a thread of their own: a load of other keys
does not wait behind a write in progress, and what the write stored is there once it is done."""

from __future__ import annotations

import os

import numpy as np
import ray

from hpsray.actors.ssdps import SSDPSShard, actor_class


def _block_writes_until(flag: str):
    """For ``__ray_call__``: the store's next write stops once its files are written, until ``flag`` exists."""

    def install(shard: SSDPSShard) -> None:
        import time

        def hook(point: str) -> None:
            while point == "dump:written" and not os.path.exists(flag):
                time.sleep(0.01)

        shard.store.state.hook = hook

    return install


def test_a_load_runs_while_a_write_is_in_progress_and_then_sees_it(ray_local, tmp_path):
    w = 8
    shard = actor_class().options(num_cpus=0, max_concurrency=1).remote(0, str(tmp_path / "ssd"), w)
    old = np.arange(1, 101, dtype=np.uint64)
    ray.get(shard.dump.remote(old, np.ones((old.size, w), np.float32)))
    flag = str(tmp_path / "go")
    ray.get(shard.__ray_call__.remote(_block_writes_until(flag)))
    new = np.arange(1000, 1100, dtype=np.uint64)
    writing = shard.dump.remote(new, np.full((new.size, w), 2.0, np.float32))
    # the write is held inside the store; a load of other keys still answers
    rows, found = ray.get(shard.load_found.remote(old), timeout=60)
    assert found.all() and (rows == 1).all()
    assert ray.wait([writing], timeout=0)[1] == [writing]  # still in progress
    open(flag, "w").close()
    ray.get(writing, timeout=60)
    rows, found = ray.get(shard.load_found.remote(new))
    assert found.all() and (rows == 2).all()
    ray.get(shard.close.remote())
    ray.kill(shard)
