"""``hpsray bench bigger-than-memory``: train a model larger than the memory its processes get.

Every hpsray process runs inside a memory cgroup of its own (cgroup v1 ``memory.limit_in_bytes``
or v2 ``memory.max``; needs root) limited to ``--memory-limit``. The phases, each a child process
started inside the cgroup (Ray and its workers inherit it):

1. **table** (this process, outside the cgroup): a "pretrained" Parquet table of every key of the
   vocabulary (``--slots`` × keys per slot, sized so the rows take ``--ratio`` × the limit on
   disk), values from :func:`table_rows`, a plain deterministic function of the key;
2. **import** (cgroup): :meth:`~hpsray.tiers.ssd.SSDPS.bulk_load` of the table into the node's
   SSD-PS directory (what ``[tiers] init_from`` runs); the Parquet files are then removed;
3. **train** (cgroup): the pipeline over that store (MEM-PS ``--mem-rows``), planted data whose
   Zipf keys are spread over the whole vocabulary; warm-up batches, then a timed pass; MEM-PS
   flushed and the dense weights saved;
4. **crash** (cgroup): a process reopens the store and rewrites rows (same values) until it is
   killed with ``kill -9``; **check** (cgroup): a new process reopens the store (timed: key-map
   recovery) and reads every row the data touched plus a sample of untouched ones;
5. **in memory** (a cgroup without a limit): the same job (data, model, batches) with every row
   it touches in MEM-PS and no table (rows start from the initialiser), for examples/s.

Losslessness: the reference trainer (this process) starts from :func:`table_rows` of the keys the
data touches, trains the same batches, and every touched row and dense weight must be equal bit
for bit; the sampled untouched rows must equal the table. Also reported: the cgroup's peak
(kernel counter, page cache included, and sampled resident memory without it), disk high-water
mark ÷ live bytes, key-map bytes per key and reopen seconds per 100M keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

HELP = "every hpsray process in a memory cgroup; a store several times its limit, imported, trained, reopened"

TABLE_SEED = 77  # the "pretrained" table's values differ from the initialiser's (seed 0)
TABLE_STATE = 0.25  # and so does its optimizer state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-limit", default="4GiB", help="the cgroup's memory limit (default 4GiB)")
    parser.add_argument("--ratio", type=float, default=4.2, help="model bytes on disk / memory limit")
    parser.add_argument("--dim", type=int, default=64, help="embedding width (adagrad: rows of 2 x dim floats)")
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--hidden", default="256,128")
    parser.add_argument("--examples", type=int, default=320_000, help="examples of the timed pass")
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--minibatch", type=int, default=2048)
    parser.add_argument("--mem-rows", type=int, default=600_000, help="MEM-PS capacity of the bigger-than-memory run")
    parser.add_argument("--io-threads", type=int, default=4, help="SSD-PS I/O threads ([tiers.ssd] io_threads)")
    parser.add_argument("--object-store", default="512MiB", help="Ray object store memory of each run")
    parser.add_argument("--sample", type=int, default=200_000, help="untouched rows compared with the table")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one under /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")


def _size(text: str) -> int:
    from hpsray.job.validate import size

    return size(text)


def table_rows(keys: np.ndarray, dim: int, width: int) -> np.ndarray:
    """The imported table's row of each key: a deterministic function of the key (the seeded
    initialiser with another seed and state), so the reference needs no copy of the table."""
    from hpsray.kernels.init import RowInit, initial_rows

    return initial_rows(keys, width, RowInit(dim=dim, scale=0.05, seed=TABLE_SEED, state_value=TABLE_STATE))


@dataclass
class Job:
    """What every phase agrees on (passed to the children as JSON)."""

    dim: int
    width: int
    slots: int
    keys_per_slot: int
    dense: int
    zipf: float
    hidden: list[int]
    batch: int
    minibatch: int
    warmup_rows: int
    examples: int
    mem_rows: int
    object_store: int
    io_threads: int = 4

    def generator(self) -> Any:
        from hpsray.data import PlantedCTR

        return PlantedCTR(
            n_slots=self.slots, keys_per_slot=self.keys_per_slot, n_dense=self.dense, zipf_a=self.zipf, seed=3
        )

    def config(self) -> Any:
        from hpsray.config import TrainConfig

        return TrainConfig(
            dim=self.dim,
            hidden=tuple(self.hidden),
            minibatch_size=self.minibatch,
            sparse_optimizer="adagrad",
            sparse_lr=0.05,
        )

    def sources(self) -> tuple[Any, Any]:
        """The warm-up source and the timed pass's source (consecutive rows of one stream)."""
        from hpsray.pipelines import SyntheticSource

        gen = self.generator()
        return SyntheticSource(gen, self.warmup_rows), SyntheticSource(gen, self.examples, start_row=self.warmup_rows)


# -- memory cgroups --------------------------------------------------------------------------


class Cgroup:
    """A memory cgroup of its own (v1 ``memory`` controller or v2), removed by :meth:`remove`."""

    def __init__(self, name: str, limit: int | None) -> None:
        v1 = "/sys/fs/cgroup/memory"
        v2 = "/sys/fs/cgroup"
        if os.path.isfile(os.path.join(v1, "memory.limit_in_bytes")):
            self.v2 = False
            self.path = os.path.join(v1, name)
        elif "memory" in _read(os.path.join(v2, "cgroup.controllers"), ""):
            self.v2 = True
            self.path = os.path.join(v2, name)
        else:
            raise RuntimeError("no memory cgroup controller (cgroup v1 memory or v2 memory) on this machine")
        try:
            os.makedirs(self.path, exist_ok=True)
        except PermissionError as e:
            raise RuntimeError(f"cannot create the memory cgroup {self.path}: run as root ({e})") from e
        self.limit = limit
        if limit is not None:
            self._write("memory.max" if self.v2 else "memory.limit_in_bytes", str(limit))
            if not self.v2:
                try:
                    self._write("memory.memsw.limit_in_bytes", str(limit))  # no swap either, where accounted
                except OSError:
                    pass

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``)."""
        self._write("cgroup.procs", str(os.getpid()))

    def reset_peak(self) -> None:
        if not self.v2:
            self._write("memory.max_usage_in_bytes", "0")
        else:
            try:
                self._write("memory.peak", "0")  # kernels >= 6.12 reset it; older ones refuse
            except OSError:
                pass

    def usage(self) -> int:
        return int(_read(os.path.join(self.path, "memory.current" if self.v2 else "memory.usage_in_bytes"), "0"))

    def peak(self) -> int:
        return int(_read(os.path.join(self.path, "memory.peak" if self.v2 else "memory.max_usage_in_bytes"), "0"))

    def resident(self) -> int:
        """Memory that is not page cache: anonymous + shared memory (Ray's object store)."""
        st = dict(line.split() for line in _read(os.path.join(self.path, "memory.stat"), "").splitlines())
        if self.v2:
            return int(st.get("anon", 0)) + int(st.get("shmem", 0))
        return int(st.get("total_rss", st.get("rss", 0))) + int(st.get("total_shmem", st.get("shmem", 0)))

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in _read(os.path.join(self.path, name), "").splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def remove(self, wait_s: float = 15.0) -> None:
        """Remove the cgroup once the processes started in it have exited (Ray's workers may
        outlive their driver by a few seconds); left in place if some are still there."""
        deadline = time.monotonic() + wait_s
        while _read(os.path.join(self.path, "cgroup.procs"), "").split() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _read(path: str, default: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


class Monitor:
    """Samples a cgroup's resident memory and a directory's bytes on disk in a thread."""

    def __init__(self, cgroup: Cgroup, directory: str | None, period: float = 0.25) -> None:
        self.cgroup, self.directory, self.period = cgroup, directory, period
        self.peak_resident = 0
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_resident = max(self.peak_resident, self.cgroup.resident())
            if self.directory:
                self.peak_disk = max(self.peak_disk, _dir_bytes(self.directory))
            self._stop.wait(self.period)

    def __enter__(self) -> Monitor:
        self.cgroup.reset_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _dir_bytes(directory: str) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _start(phase: str, cgroup: Cgroup, payload: dict) -> subprocess.Popen:
    """Start ``phase`` of this module in a new process inside ``cgroup``."""
    cmd = [sys.executable, "-m", "hpsray.bench.bigger_than_memory", phase, json.dumps(payload)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=cgroup.join
    )


def _child(phase: str, cgroup: Cgroup, payload: dict) -> dict:
    """Run ``phase`` in a new process inside ``cgroup``; returns its JSON answer."""
    proc = _start(phase, cgroup, payload)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench bigger-than-memory: the {phase} phase failed (exit {proc.returncode}; "
            f"{cgroup.oom_kills()} OOM kills in the cgroup):\n{err[-4000:]}"
        )
    return json.loads(out.strip().splitlines()[-1])


# -- phases (children) -----------------------------------------------------------------------


def _phase_import(p: dict) -> dict:
    from hpsray.tiers.ssd import SSDPS, TableImport

    with SSDPS(p["store"], p["width"]) as store:
        done = store.bulk_load(TableImport(p["table"], p["dim"], TABLE_STATE))
        done["key_map_bytes"] = store.stats["key_map_bytes"]
    return done


def _pipeline(job: Job, ssd_path: str, mem_rows: int, sources: tuple) -> Any:
    import ray

    from hpsray.pipelines import MemPSStage, Pipeline, SSDPSStage, TrainerStage

    ray.init(address="local", include_dashboard=False, object_store_memory=job.object_store, log_to_driver=False)
    return Pipeline(
        sources[0],
        TrainerStage(job.config()),
        MemPSStage(capacity_rows=mem_rows),
        SSDPSStage(ssd_path, options={"io_threads": job.io_threads}),
        batch_size=job.batch,
    )


def _phase_train(p: dict) -> dict:
    import ray
    import torch

    job = Job(**p["job"])
    warm, timed = job.sources()
    with _pipeline(job, p["ssd"], p["mem_rows"], (warm, timed)) as pipe:
        pipe.fit(progress=False)
        pipe.source = timed
        report = pipe.fit(progress=False)
        actors = pipe.actors()
        ray.get(actors["MemPS[node 0]"].flush.remote())  # every trained row on SSD-PS
        store = ray.get(actors["SSDPS[node 0]"].stats.remote())["store"]
        if p.get("dense"):
            torch.save(pipe.dense_state(), p["dense"])
    return {
        "examples_per_s": report["examples_per_s"],
        "wall_s": report["wall_s"],
        "examples": report["examples"],
        "batches": report["batches"],
        "pipeline_efficiency": report.get("pipeline_efficiency"),
        "stage_busy_s": report.get("stage_busy_s"),
        "cache_hit_rate_mean": float(np.mean(list(report["cache_hit_rate"].values()))),
        "ssd": {k: store[k] for k in ("live_rows", "live_bytes", "disk_bytes", "space_ratio", "bytes_read", "files")},
    }


def _phase_crash(p: dict) -> None:
    from hpsray.tiers.ssd import SSDPS

    store = SSDPS(p["store"])
    keys = np.load(p["touched"])
    rng = np.random.default_rng(0)
    print("open", flush=True)
    while True:  # rewrite rows with the values they have until killed
        k = np.unique(rng.choice(keys, 20_000))
        rows, _ = store.load(k)
        store.dump(k, rows)
        print("dumped", flush=True)


def _phase_check(p: dict) -> dict:
    from hpsray.tiers.ssd import SSDPS

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as empty:  # numba's cached kernels load here: a fixed cost
        SSDPS(empty, p["width"]).close()
    fixed = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = SSDPS(p["store"])
    reopen = time.perf_counter() - t0
    try:
        out: dict[str, Any] = {
            "reopen_s": reopen,
            "reopen_fixed_s": fixed,
            "keys": len(store),
            "key_map_bytes": store.stats["key_map_bytes"],
        }
        for name in ("touched", "sample"):
            keys = np.load(p[name])
            rows, found = store.load(keys)
            np.save(p[name + "_rows"], rows)
            out[name + "_found"] = int(found.sum())
        out["stats"] = {k: store.stats[k] for k in ("live_bytes", "disk_bytes", "space_ratio", "files")}
    finally:
        store.close()
    return out


# -- the benchmark (parent) ------------------------------------------------------------------


def _write_table(directory: str, job: Job, rows_per_file: int = 1 << 20) -> dict:
    """The Parquet table of every key of the vocabulary, ``rows_per_file`` rows a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hpsray.data.keys import hash_keys

    os.makedirs(directory)
    t0 = time.perf_counter()
    n = job.slots * job.keys_per_slot
    files = []
    for i, start in enumerate(range(0, n, rows_per_file)):
        idx = np.arange(start, min(n, start + rows_per_file), dtype=np.uint64)
        keys = hash_keys((idx // np.uint64(job.keys_per_slot)).astype(np.int64), idx % np.uint64(job.keys_per_slot))
        rows = table_rows(keys, job.dim, job.width)
        w = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(rows[:, : job.dim]).reshape(-1)), job.dim)
        s = pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(rows[:, job.dim :]).reshape(-1)), job.width - job.dim
        )
        name = f"rows-{i:05d}.parquet"
        pq.write_table(
            pa.table({"key": pa.array(keys), "weights": w, "state": s}),
            os.path.join(directory, name),
            compression="none",
        )
        files.append(name)
    return {"rows": n, "files": len(files), "bytes": _dir_bytes(directory), "seconds": time.perf_counter() - t0}


def _touched(job: Job) -> np.ndarray:
    warm, timed = job.sources()
    keys = [np.unique(b.keys) for src in (warm, timed) for b in src.open(job.batch)]
    return np.unique(np.concatenate(keys))


def _reference(job: Job, touched: np.ndarray) -> tuple[Any, float]:
    from hpsray.reference import ReferenceTrainer

    warm, timed = job.sources()
    ref = ReferenceTrainer(job.slots, job.dense, job.config())
    ref.store.preload(touched, table_rows(touched, job.dim, job.width))
    t0 = time.perf_counter()
    ref.fit(warm.open(job.batch))
    ref.fit(timed.open(job.batch))
    return ref, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    import torch

    from hpsray.tiers.ssd.paramfile import record_bytes

    limit = _size(args.memory_limit)
    width = 2 * args.dim  # adagrad: one accumulator per weight
    rec = record_bytes(width)
    n_keys = int(np.ceil(args.ratio * limit / rec))
    keys_per_slot = -(-n_keys // args.slots)
    job = Job(
        dim=args.dim,
        width=width,
        slots=args.slots,
        keys_per_slot=keys_per_slot,
        dense=args.dense,
        zipf=args.zipf,
        hidden=[int(h) for h in args.hidden.split(",") if h],
        batch=args.batch,
        minibatch=args.minibatch,
        warmup_rows=args.warmup_batches * args.batch,
        examples=args.examples,
        mem_rows=args.mem_rows,
        object_store=_size(args.object_store),
        io_threads=args.io_threads,
    )
    base = args.dir or tempfile.mkdtemp(prefix="hpsray-btm-", dir="/var/tmp")
    os.makedirs(base, exist_ok=True)
    free = shutil.disk_usage(base).free
    need = int(2.3 * n_keys * rec)
    if free < need:
        raise RuntimeError(f"bench bigger-than-memory: {base} has {free} bytes free, the run needs ~{need}")
    tag = f"hpsray-btm-{os.getpid()}"
    limited = Cgroup(tag, limit)
    unlimited = Cgroup(tag + "-mem", None)
    table, ssd = os.path.join(base, "table"), os.path.join(base, "ssd")
    store = os.path.join(ssd, "node-0")
    out: dict = {"memory_limit_bytes": limit, "cgroup": "v2" if limited.v2 else "v1"}
    try:
        written = _write_table(table, job)
        touched = _touched(job)
        rng = np.random.default_rng(1)
        untouched = np.setdiff1d(
            _vocabulary_sample(job, rng, min(args.sample * 2, job.slots * job.keys_per_slot)), touched
        )[: args.sample]
        files = {name: os.path.join(base, f"{name}.npy") for name in ("touched", "sample")}
        np.save(files["touched"], touched)
        np.save(files["sample"], untouched)

        with Monitor(limited, store) as mon:
            imported = _child("import", limited, {"store": store, "table": table, "dim": job.dim, "width": width})
        import_peak, import_resident = limited.peak(), mon.peak_resident
        shutil.rmtree(table)

        model_bytes = _dir_bytes(store)
        live = imported["rows"] * rec
        dense_path = os.path.join(base, "dense.pt")
        with Monitor(limited, store) as mon:
            trained = _child(
                "train", limited, {"job": job.__dict__, "ssd": ssd, "mem_rows": job.mem_rows, "dense": dense_path}
            )
        train_peak, train_resident, disk_high = limited.peak(), mon.peak_resident, mon.peak_disk

        crash = _start("crash", limited, {"store": store, "touched": files["touched"]})
        assert crash.stdout is not None
        dumps = 0
        for line in crash.stdout:
            dumps += line.strip() == "dumped"
            if dumps >= 3:
                break
        os.kill(crash.pid, signal.SIGKILL)
        crash.wait()
        with Monitor(limited, store) as mon:
            checked = _child(
                "check",
                limited,
                {
                    **files,
                    "width": width,
                    "store": store,
                    "touched_rows": files["touched"] + ".rows.npy",
                    "sample_rows": files["sample"] + ".rows.npy",
                },
            )
        check_peak = limited.peak()

        ref, ref_s = _reference(job, touched)
        ref_keys, ref_rows, ref_dense = ref.export()
        got = np.load(files["touched"] + ".rows.npy")
        order = np.searchsorted(ref_keys, touched)
        rows_equal = bool(np.array_equal(got, ref_rows[order]))
        sample_equal = bool(
            np.array_equal(np.load(files["sample"] + ".rows.npy"), table_rows(untouched, job.dim, width))
        )
        dense = torch.load(dense_path, weights_only=True)
        dense_equal = all(torch.equal(dense[k], v) for k, v in ref_dense.items())

        shutil.rmtree(ssd)  # the in-memory run: the same job, every touched row in MEM-PS, no table
        with Monitor(unlimited, None):
            in_memory = _child(
                "train",
                unlimited,
                {"job": job.__dict__, "ssd": ssd, "mem_rows": int(touched.size) + 4 * job.batch * job.slots},
            )
        in_memory_peak = unlimited.peak()

        out.update(
            model_bytes_on_disk=model_bytes,
            model_rows=imported["rows"],
            model_vs_limit=model_bytes / limit,
            peak_memory_bytes=max(train_peak, import_peak, check_peak),
            peak_resident_bytes=max(train_resident, import_resident),
            peak_within_limit=max(train_peak, import_peak, check_peak) <= limit,
            oom_kills=limited.oom_kills(),
            examples_per_s=trained["examples_per_s"],
            in_memory_examples_per_s=in_memory["examples_per_s"],
            vs_in_memory=trained["examples_per_s"] / in_memory["examples_per_s"],
            lossless={
                "equal": rows_equal and sample_equal and dense_equal,
                "touched_rows": int(touched.size),
                "touched_rows_equal": rows_equal,
                "untouched_sampled": int(untouched.size),
                "untouched_equal_to_table": sample_equal,
                "dense_equal": dense_equal,
                "reference_s": ref_s,
            },
            disk_high_water_bytes=disk_high,
            live_bytes=live,
            disk_high_water_vs_live=disk_high / live,
            key_map_bytes_per_key=checked["key_map_bytes"] / max(checked["keys"], 1),
            disk_bytes_per_key=model_bytes / imported["rows"],
            reopen_seconds=checked["reopen_s"],
            reopen_fixed_seconds=checked["reopen_fixed_s"],
            reopen_keys=checked["keys"],
            reopen_seconds_per_100m_keys=checked["reopen_s"] * 1e8 / max(checked["keys"], 1),
            crash={"dumps_acknowledged_before_kill": dumps},
            planned=_planned(job, imported["rows"], int(touched.size), limit),
            phases={
                "table": written,
                "import": {
                    **imported,
                    "peak_memory_bytes": import_peak,
                    "peak_resident_bytes": import_resident,
                    "key_map_bytes_per_key": imported["key_map_bytes"] / imported["rows"],
                },
                "train": {**trained, "peak_memory_bytes": train_peak, "peak_resident_bytes": train_resident},
                "check": {**checked, "peak_memory_bytes": check_peak},
                "in_memory": {**in_memory, "peak_memory_bytes": in_memory_peak, "mem_rows": int(touched.size)},
            },
            job={**job.__dict__, "model_keys": job.slots * job.keys_per_slot},
        )
    finally:
        limited.remove()
        unlimited.remove()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return out


def _planned(job: Job, rows: int, touched: int, limit: int) -> dict:
    """What ``hpsray plan`` predicts for this job (the same sizing functions): the node's memory
    (Ray and processes, key map at its peak, MEM-PS, the object store) and the disk's high water."""
    from hpsray.plan.footprint import RUNTIME_BYTES, disk_high_water, ssd_memory
    from hpsray.plan.sizing import mem_bytes_for_rows

    ssd = ssd_memory(rows, job.width, imported=rows)
    memory = {
        "runtime_bytes": RUNTIME_BYTES,
        "key_map_bytes": ssd["key_map_bytes"] + ssd["block_table_bytes"],
        "mem_ps_bytes": mem_bytes_for_rows(job.mem_rows, job.width),
        "object_store_bytes": job.object_store,
    }
    disk = disk_high_water(rows, job.width, touched, 1.5, 2.0)
    return {
        **memory,
        "memory_bytes": sum(memory.values()),
        "memory_limit_bytes": limit,
        "key_map_peak_bytes": ssd["key_map_peak_bytes"],
        "bytes_per_key_memory": ssd["bytes_per_key_memory"],
        "bytes_per_key_disk": ssd["bytes_per_key_disk"],
        "disk_high_water_bytes": disk["expected_bytes"],
    }


def _vocabulary_sample(job: Job, rng: np.random.Generator, n: int) -> np.ndarray:
    from hpsray.data.keys import hash_keys

    idx = rng.choice(job.slots * job.keys_per_slot, size=n, replace=False).astype(np.uint64)
    return np.unique(
        hash_keys((idx // np.uint64(job.keys_per_slot)).astype(np.int64), idx % np.uint64(job.keys_per_slot))
    )


def _main() -> None:
    phase, payload = sys.argv[1], json.loads(sys.argv[2])
    if phase == "crash":
        _phase_crash(payload)
        return
    result = {"import": _phase_import, "train": _phase_train, "check": _phase_check}[phase](payload)
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
