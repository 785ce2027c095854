"""``hpsray bench layout``: what placing SSD-PS rows by their load heat gains a second pass.

Two stores of the same rows (filled in key order, as an import leaves them; the keys are hashes,
so hot and cold rows interleave) each serve a MEM-PS cache through two passes of Zipf batches —
pull, load the misses, update every row, write back, evictions dumped — as the pipeline's pull,
load and train stages do. Between the passes each store is rewritten whole
(:meth:`~hpsray.tiers.ssd.store.SSDPS.relayout`): ``as_read`` without load heat (rows keep the
order compaction reads them in, today's layout), ``by_heat`` with it (the rows loads wanted most
first). The second pass, on fresh batches of the same distribution with the page cache dropped,
measures each layout: 4 KiB pages read per missed row (``pages_per_missed_row``), the reads and
the load seconds; ``oracle_pages_per_missed_row`` is what a layout by every row's true frequency
would read for the same misses. Both stores must end holding the same rows (``same_rows``):
layout is placement only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from hpsray.bench.cache import make_trace
from hpsray.bench.disk_bound import delta
from hpsray.fileio import drop_cache
from hpsray.kernels.hashing import mix64_array
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.ssd.heat import DEFAULT_HEAT_COUNTERS
from hpsray.tiers.ssd.paramfile import SUFFIX, record_bytes
from hpsray.tiers.ssd.reads import PAGE_BYTES

HELP = "SSD-PS pages read per missed row on a second pass, rows laid out by load heat vs as read"

ARMS = {"as_read": 0, "by_heat": DEFAULT_HEAT_COUNTERS}  # arm: the store's heat_counters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the store (the key universe)")
    parser.add_argument("--width", type=int, default=128, help="floats per row (the bigger-than-memory job's)")
    parser.add_argument("--cache", type=float, default=0.1, help="MEM-PS rows as a share of --rows (default 0.1)")
    parser.add_argument("--batch", type=int, default=65_536, help="Zipf key draws per batch")
    parser.add_argument("--batches", type=int, default=40, help="batches per pass")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the key draws")
    parser.add_argument("--io-threads", type=int, default=4, help="the stores' I/O threads")
    parser.add_argument("--dir", default=None, help="directory to work in (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)


def _fill(store: SSDPS, keys: np.ndarray, width: int, chunk: int = 1 << 17) -> None:
    """Every key's first row (a function of the key), dumped in key order."""
    for i in range(0, keys.size, chunk):
        k = keys[i : i + chunk]
        store.dump(k, np.broadcast_to((k % np.uint64(1000)).astype(np.float32)[:, None], (k.size, width)))


def _pass(mem: MemPS, store: SSDPS, trace: list[np.ndarray], first_id: int, missed_keys: list | None = None) -> dict:
    """Pull, load the misses, add 1 to every row, write back: one batch of ``trace`` after another
    (each batch's missed keys appended to ``missed_keys``)."""
    before = store.stats
    t0 = time.perf_counter()
    missed = 0
    for t, draws in enumerate(trace):
        keys = np.unique(draws)
        rows, missing = mem.pull(first_id + t, keys)
        if missing.size:
            got, found = store.load(keys[missing])
            if not found.all():
                raise AssertionError(f"{int((~found).sum())} rows missing from the store")
            rows[missing] = got
            missed += int(missing.size)
            if missed_keys is not None:
                missed_keys.append(keys[missing])
        mem.write_back(first_id + t, keys, rows + 1.0)
        mem.unpin(first_id + t)
    counts = delta(store.stats, before)
    rows_loaded = max(int(counts["rows_loaded"]), 1)
    return {
        "seconds": time.perf_counter() - t0,
        "rows_missed": missed,
        "pages_read": int(counts["pages_read"]),
        "pages_per_missed_row": counts["pages_read"] / rows_loaded,
        "reads_per_missed_row": counts["reads_issued"] / rows_loaded,
        "bytes_per_missed_row": counts["bytes_read"] / rows_loaded,
        "load_seconds": float(counts["load_seconds"]),
        "load_cpu_seconds": float(counts["load_cpu_seconds"]),
    }


def _arm(
    directory: str,
    heat_counters: int,
    keys: np.ndarray,
    passes: list[list[np.ndarray]],
    args: argparse.Namespace,
    missed_keys: list,
) -> dict:
    store = SSDPS(directory, args.width, io_threads=args.io_threads, heat_counters=heat_counters)
    try:
        t0 = time.perf_counter()
        _fill(store, keys, args.width)
        fill_s = time.perf_counter() - t0
        mem = MemPS(max(1, int(args.cache * keys.size)), args.width, store)
        first = _pass(mem, store, passes[0], 0)
        store.wait_compaction()
        t0 = time.perf_counter()
        rewritten = store.relayout()
        relayout_s = time.perf_counter() - t0
        drop_cache(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(SUFFIX))
        second = _pass(mem, store, passes[1], len(passes[0]), missed_keys)
        mem.flush()
        rows, found = store.load(keys)
        return {
            "fill_seconds": fill_s,
            "first_pass": first,
            "relayout": {"files": rewritten, "seconds": relayout_s},
            "second_pass": second,
            "files": store.stats["files"],
            "_rows": rows.copy() if found.all() else None,
        }
    finally:
        store.close()


def oracle_pages_per_row(missed: list[np.ndarray], universe: int, record: int) -> float:
    """Pages per missed row had every row been laid out by its true frequency (the Zipf rank the
    traces draw: key ``mix64(rank)``), rows of ``record`` bytes back to back: the most any
    frequency layout can gain on these misses."""
    by_rank = mix64_array(np.arange(universe, dtype=np.uint64))
    order = np.argsort(by_rank)
    ascending = by_rank[order]
    pages = rows = 0
    for k in missed:
        rank = order[np.searchsorted(ascending, k)].astype(np.int64)
        first, last = rank * record // PAGE_BYTES, ((rank + 1) * record - 1) // PAGE_BYTES
        pages += np.unique(np.concatenate([first, last])).size
        rows += k.size
    return pages / max(rows, 1)


def run(args: argparse.Namespace) -> dict:
    if args.rows < 2 or args.width < 1 or not 0.0 < args.cache < 1.0:
        raise SystemExit("bench layout: need --rows >= 2, --width >= 1 and 0 < --cache < 1")
    keys = np.sort(mix64_array(np.arange(args.rows, dtype=np.uint64)))  # what the traces draw
    passes = [
        make_trace(
            "zipf", universe=args.rows, batch=args.batch, batches=args.batches, a=args.zipf, drift=0, seed=args.seed + p
        )
        for p in range(2)
    ]
    work = args.dir or tempfile.mkdtemp(prefix="hpsray-layout-")
    report: dict = {
        "config": {
            "rows": args.rows,
            "width": args.width,
            "cache_rows": max(1, int(args.cache * args.rows)),
            "batch": args.batch,
            "batches": args.batches,
            "zipf": args.zipf,
            "io_threads": args.io_threads,
            "directory": work,
        }
    }
    rows = {}
    missed: dict[str, list] = {}
    try:
        for name, counters in ARMS.items():
            missed[name] = []
            arm = _arm(os.path.join(work, name), counters, keys, passes, args, missed[name])
            rows[name] = arm.pop("_rows")
            report[name] = arm
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    a, h = report["as_read"]["second_pass"], report["by_heat"]["second_pass"]
    report["pages_per_missed_row_gain"] = a["pages_per_missed_row"] / max(h["pages_per_missed_row"], 1e-12)
    report["load_seconds_ratio"] = h["load_seconds"] / max(a["load_seconds"], 1e-12)
    report["oracle_pages_per_missed_row"] = oracle_pages_per_row(missed["by_heat"], args.rows, record_bytes(args.width))
    report["same_rows"] = bool(
        rows["as_read"] is not None and rows["by_heat"] is not None and np.array_equal(rows["as_read"], rows["by_heat"])
    )
    return report
