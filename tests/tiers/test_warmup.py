"""The warm-up compiles, before the clock, every numba kernel a real batch then runs.

Checked in a fresh interpreter with an empty numba cache: after the three warm-ups, a real
workload (MEM-PS over an SSD-PS directory with evictions and loads, and a trainer's steps on
HBM-PS, fed read-only arrays as Ray's object store hands them to the actors) adds no compiled
signature to any of hpsray's numba functions.
"""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import numpy as np
    from numba.core.registry import CPUDispatcher

    from hpsray.actors.trainer import Trainer
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.tiers.hbm import HbmPS
    from hpsray.tiers.mem import MemPS
    from hpsray.tiers.ssd import SSDPS
    from hpsray.tiers.warmup import warm_mem_ps, warm_ssd_ps

    def compiled():
        out = {}
        for name, mod in list(sys.modules.items()):
            if name.startswith("hpsray.") and mod is not None:
                for attr, obj in vars(mod).items():
                    if isinstance(obj, CPUDispatcher):
                        out[f"{name}.{attr}"] = len(obj.signatures)
        return out

    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=100, sparse_optimizer="adagrad")
    gen = PlantedCTR(n_slots=4, keys_per_slot=500, n_dense=3, seed=2)
    warm_mem_ps(cfg.row_width, cfg.row_init())
    warm_ssd_ps(cfg.row_width, rows_per_file=64)
    trainer = Trainer(0, 1, cfg, gen.n_slots, gen.n_dense, 2000, n_devices=2)  # warms its step
    before = compiled()

    with tempfile.TemporaryDirectory() as d:
        ssd = SSDPS(d, cfg.row_width, rows_per_file=64)
        mem = MemPS(700, cfg.row_width, ssd, cfg.row_init())  # < the 2,000 keys: evictions and loads
        def frozen(a):  # what an actor receives through the object store
            a = np.array(a)
            a.setflags(write=False)
            return a

        for t in range(6):
            batch = gen.generate(200, start_row=200 * t)
            keys = frozen(np.unique(batch.keys))
            rows = frozen(mem.pull(t, keys))
            trainer.hbm.insert(keys, rows)
            trainer.hbm.retain(keys)
            trainer._train_local(batch)
            mem.write_back(t, keys, frozen(trainer.hbm.get(keys)))
            mem.unpin(t)
        mem.flush()
        totals = mem.stats
        ssd.close()
    after = compiled()
    print(json.dumps({"before": before, "after": after, "evicted": totals["evicted"], "loaded": totals["loaded"]}))
    """
)


def test_a_real_batch_compiles_nothing_after_the_warm_up(tmp_path):
    env_cache = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    import os

    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env_cache},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = got["before"], got["after"]
    assert got["evicted"] > 0 and got["loaded"] > 0, "the workload should evict rows and load them back"
    assert sum(before.values()) >= 10, before  # the warm-ups did compile the engines' kernels
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, f"compiled during the real batches (signatures before, after): {grew}"
