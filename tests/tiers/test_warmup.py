"""The warm-up compiles, before the clock, every numba kernel a real batch then runs.

Each stage actor is a process of its own, so each role is checked in a fresh interpreter with
an empty numba cache: after the role's warm-up, a real workload of that role (fed read-only
arrays, as Ray's object store hands them to the actors) adds no compiled signature to any of
hpsray's numba functions.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import numpy as np
    from numba.core.registry import CPUDispatcher

    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR

    def compiled():
        out = {}
        for name, mod in list(sys.modules.items()):
            if name.startswith("hpsray.") and mod is not None:
                for attr, obj in vars(mod).items():
                    if isinstance(obj, CPUDispatcher):
                        out[f"{name}.{attr}"] = len(obj.signatures)
        return out

    def frozen(a):  # what an actor receives through the object store
        a = np.array(a)
        a.setflags(write=False)
        return a

    role = sys.argv[1]
    cfg = TrainConfig(dim=4, hidden=(16,), minibatch_size=100, sparse_optimizer="adagrad")
    gen = PlantedCTR(n_slots=4, keys_per_slot=500, n_dense=3, seed=2)
    batches = [gen.generate(200, start_row=200 * t) for t in range(6)]
    facts = {}

    if role == "ssd":
        from hpsray.tiers.loans import Pulled
        from hpsray.tiers.ssd import SSDPS
        from hpsray.tiers.warmup import warm_ssd_ps

        warm_ssd_ps(cfg.row_width, rows_per_file=2048)
        before = compiled()
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory() as d:
            ssd = SSDPS(d, cfg.row_width, rows_per_file=2048)
            keys = np.unique(rng.integers(1, 2**62, 40_000).astype(np.uint64))  # the key map grows
            for i in range(0, keys.size, 10_000):
                part = keys[i : i + 10_000]
                ssd.dump(frozen(part), frozen(np.ones((part.size, cfg.row_width), np.float32)))
                asked = np.unique(np.r_[keys[rng.integers(0, i + part.size, 3000)], rng.integers(1, 2**62, 500)])
                rows, found = ssd.load(frozen(asked.astype(np.uint64)))
                facts["found"] = facts.get("found", 0) + int(found.sum())
                # the load stage as the actor runs it: a pulled loan's misses, unknown keys initialised
                missing = np.arange(0, asked.size, 2)
                pulled = Pulled(frozen(np.zeros((asked.size, cfg.row_width), np.float32)), frozen(missing),
                                frozen(asked[missing].astype(np.uint64)), cfg.row_init())
                facts["initialised"] = facts.get("initialised", 0) + missing.size - pulled.load_missing(ssd.load)[1]
            ssd.close()
    elif role == "mem":
        from hpsray.tiers.mem import MemPS
        from hpsray.tiers.warmup import _DictStore, warm_mem_ps

        warm_mem_ps(cfg.row_width, cfg.row_init())
        before = compiled()
        from hpsray.tiers.loans import Pulled

        store = _DictStore(cfg.row_width)
        mem = MemPS(700, cfg.row_width, store, cfg.row_init())  # < the 2,000 keys
        loaded = 0
        for t, batch in enumerate(batches):
            keys = frozen(np.unique(batch.keys))
            rows, missing = mem.pull(t, keys)  # the load stage fills the misses, as on the SSD-PS actor
            rows, n = Pulled(rows, missing, keys[missing], cfg.row_init()).load_missing(store.load)
            loaded += n
            mem.write_back(t, keys, frozen(rows + 1))
            mem.unpin(t)
        mem.flush()
        facts.update(evicted=mem.stats["evicted"], loaded=loaded)
    else:
        from hpsray.actors.trainer import Trainer
        from hpsray.data.batch import Batch
        from hpsray.kernels.init import initial_rows
        from hpsray.tiers.loans import Loan

        trainer = Trainer(0, 1, cfg, gen.n_slots, gen.n_dense, 2000)  # warms its step
        before = compiled()
        engine = trainer.engine
        for t, batch in enumerate(batches):
            batch = Batch(**{f: frozen(getattr(batch, f)) for f in ("labels", "dense", "keys", "offsets", "slots")},
                          n_slots=batch.n_slots)
            keys = np.unique(batch.keys)
            rows = frozen(initial_rows(keys, cfg.row_width, cfg.row_init()))  # as MEM-PS lends them
            keys = frozen(keys)
            engine.borrow(t, [keys], [Loan(rows)])  # from the second batch on, erases the stale rows
            engine.close_batch(engine.train_local(engine.index(batch)))
            engine.end_batch(t, [keys], None)
            trainer.hbm.insert_or_assign(keys[:9], frozen(trainer.hbm.get(keys[:9])))
        facts["steps"] = trainer.step
    after = compiled()
    print(json.dumps({"before": before, "after": after, "facts": facts}))
    """
)


@pytest.mark.parametrize("role", ["ssd", "mem", "trainer"])
def test_a_real_batch_compiles_nothing_after_the_warm_up(tmp_path, role):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, role], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after, facts = got["before"], got["after"], got["facts"]
    assert sum(before.values()) >= 3, before  # the warm-up did compile the role's kernels
    if role == "ssd":
        assert facts["found"] > 0 and facts["initialised"] > 0
    elif role == "mem":
        assert facts["evicted"] > 0 and facts["loaded"] > 0, "the workload should evict rows and load them back"
    else:
        assert facts["steps"] == 12
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, f"compiled during the real batches (signatures before, after): {grew}"
