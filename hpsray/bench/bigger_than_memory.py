"""``hpsray bench bigger-than-memory``: train a model larger than the memory its processes get.

Every hpsray process runs in a memory cgroup of its own limited to ``--memory-limit`` (needs root):
a table ``--ratio`` times the limit is imported into SSD-PS, trained on, its writer killed, the
store reopened and read back; the same job then runs with every row in memory. Returns the report
(``model_bytes_on_disk``, ``memory_limit_bytes``, ``peak_memory_bytes``, ``examples_per_s``,
``in_memory_examples_per_s``, ``lossless.equal``, ``disk_high_water_vs_live``,
``key_map_bytes_per_key``, ``reopen_seconds_per_100m_keys``, the disk's random-read bound measured
on the store's files after training (``disk_bound``), the timed pass's load stage beside it
(``load_stage``, ``load_reads_vs_disk_bound`` at the depth loads keep in flight; ``load_stage.hit_rate``:
the measured MEM-PS hit rate beside Belady's at ``--mem-rows`` and a never-evicting cache's;
``load_stage.dumps_per_batch`` and ``dump_busy_s_per_batch``: MEM-PS's writes to SSD-PS and the
load actor's busy time on them; ``read_bound``: the most the pass could reach beside the in-memory
run if a batch waited only for its missed rows' reads at that bound, per hit rate, and
``vs_in_memory_read_bound``, Belady's), ...).
The phases and the lossless check: docs/benchmarks.md, section "Bigger than memory". The children's side is
:mod:`~hpsray.bench.bigger_than_memory_phases`; the cgroup, :mod:`~hpsray.bench.memory_cgroup`.
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
import time
from typing import TYPE_CHECKING

import numpy as np

from hpsray.bench.bigger_than_memory_phases import Job, table_rows
from hpsray.bench.disk_bound import load_vs_bound, read_bound, store_bound
from hpsray.bench.memory_cgroup import Cgroup, Monitor, dir_bytes
from hpsray.blockio import queue_depth
from hpsray.plan.disk import cold_share, disk_s_per_row

if TYPE_CHECKING:
    from hpsray.reference import ReferenceTrainer

HELP = "every hpsray process in a memory cgroup; a store several times its limit, imported, trained, reopened"


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
    parser.add_argument(
        "--disk-probe-seconds", type=float, default=2.0, help="seconds of random reads per queue depth (the disk bound)"
    )
    parser.add_argument("--object-store", default="512MiB", help="Ray object store memory of each run")
    parser.add_argument("--sample", type=int, default=200_000, help="untouched rows compared with the table")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one under /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")


def _size(text: str) -> int:
    from hpsray.job.validate import size

    return size(text)


def _start(phase: str, cgroup: Cgroup, payload: dict) -> subprocess.Popen:
    """Start ``phase`` (:mod:`hpsray.bench.bigger_than_memory_phases`) in a new process inside ``cgroup``."""
    cmd = [sys.executable, "-m", "hpsray.bench.bigger_than_memory_phases", phase, json.dumps(payload)]
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
    return {"rows": n, "files": len(files), "bytes": dir_bytes(directory), "seconds": time.perf_counter() - t0}


def _trace(job: Job) -> tuple[list[np.ndarray], int]:
    """Each batch's distinct keys, the warm-up's then the timed pass's; and the warm-up's batches."""
    warm, timed = job.sources()
    batches = [[np.unique(b.keys) for b in src.open(job.batch)] for src in (warm, timed)]
    return batches[0] + batches[1], len(batches[0])


def _hit_rate_bounds(trace: list[np.ndarray], warm_batches: int, capacity: int) -> dict:
    """What any MEM-PS policy could hit on the timed pass: Belady's optimum at ``capacity`` and a
    cache that never evicts (every miss left a key's first use); the warm-up only warms."""
    from hpsray.tiers.cache_policy import belady_hit_rate, unbounded_hit_rate

    return {
        "capacity_rows": capacity,
        "belady": belady_hit_rate(trace, capacity, warm_batches)["hit_rate"],
        "unbounded": unbounded_hit_rate(trace, warm_batches)["hit_rate"],
    }


def _reference(job: Job, touched: np.ndarray) -> tuple[ReferenceTrainer, float]:
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
        trace, warm_batches = _trace(job)
        touched = np.unique(np.concatenate(trace))
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

        model_bytes = dir_bytes(store)
        live = imported["rows"] * rec
        dense_path = os.path.join(base, "dense.pt")
        with Monitor(limited, store) as mon:
            trained = _child(
                "train", limited, {"job": job.__dict__, "ssd": ssd, "mem_rows": job.mem_rows, "dense": dense_path}
            )
        train_peak, train_resident, disk_high = limited.peak(), mon.peak_resident, mon.peak_disk
        depth = queue_depth(job.io_threads)  # the reads a load keeps in flight (its ring's, else its threads)
        bound = store_bound(store, width, depth, args.disk_probe_seconds)  # the store's own files
        load_stage = {
            **load_vs_bound(trained["load_counts"], bound, depth),
            "load_stage_busy_s_per_batch": trained["load_stage_busy_s"] / max(trained["batches"], 1),
            "dump_busy_s_per_batch": trained["dump_busy_s"] / max(trained["batches"], 1),
            "dumps_per_batch": trained["dumps"] / max(trained["batches"], 1),
            "device": trained["device"],
            "machine_cpu_busy": trained["machine_cpu_busy"],
            "load_average": os.getloadavg()[0],
        }

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
        expected = ref_rows[order]
        rows_equal = bool(np.array_equal(got, expected))
        differing: np.ndarray | None = np.zeros(0, np.int64)  # None: the shapes differ
        if not rows_equal:
            differing = np.flatnonzero((got != expected).any(axis=1)) if got.shape == expected.shape else None
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

        planned = _planned(job, imported["rows"], int(touched.size), limit)
        # the planner's disk term (hpsray/plan/disk.py) for this run's loads, beside what they took
        cold = cold_share(model_bytes, limit - planned["memory_bytes"])
        disk_row_s = disk_s_per_row(bound, depth, cold, job.width)
        load_stage["planned_cold_share"] = cold
        load_stage["planned_disk_s_per_load"] = load_stage["rows_per_load"] * disk_row_s
        load_stage["planned_vs_measured_load_s"] = load_stage["planned_disk_s_per_load"] / max(
            load_stage["seconds_per_load"], 1e-9
        )
        # the timed pass's hit rate beside what any policy could hit on its trace (its misses are loads)
        load_stage["hit_rate"] = {
            "measured": trained["cache_hit_rate_mean"],
            **_hit_rate_bounds(trace, warm_batches, job.mem_rows),
        }
        # the most this pass could reach if each batch waited only for its misses' reads at the bound
        hit = load_stage["hit_rate"]
        bound_ratio = read_bound(
            float(np.mean([b.size for b in trace[warm_batches:]])),
            {k: hit[k] for k in ("measured", "belady", "unbounded")},
            disk_row_s,
            job.batch / in_memory["examples_per_s"],
        )
        device = trained["device"]
        if device is not None:
            rows = max(trained["load_counts"]["rows_loaded"], 1)
            load_stage["device_bytes_per_row"] = device["bytes"] / rows  # every process's reads of the disk
            load_stage["device_reads_per_row"] = device["reads"] / rows
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
                "touched_rows_differing": None if differing is None else int(differing.size),
                "touched_rows_max_abs_diff": (
                    float(np.abs(got[differing] - expected[differing]).max())
                    if differing is not None and differing.size
                    else 0.0
                ),
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
            disk_bound=bound.to_dict(),
            load_stage=load_stage,
            load_reads_vs_disk_bound=load_stage["load_reads_vs_disk_bound"],
            read_bound=bound_ratio,
            vs_in_memory_read_bound=bound_ratio["by_hit_rate"]["belady"]["vs_in_memory_at_most"],
            reopen_seconds=checked["reopen_s"],
            reopen_fixed_seconds=checked["reopen_fixed_s"],
            reopen_keys=checked["keys"],
            reopen_seconds_per_100m_keys=checked["reopen_s"] * 1e8 / max(checked["keys"], 1),
            crash={"dumps_acknowledged_before_kill": dumps},
            planned=planned,
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
