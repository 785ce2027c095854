"""``hpsray bench ssd``: SSD-PS dump / cold load throughput and space after compaction.

One run on one file system: dump ``--size`` MiB of rows, measure the disk's random-read bound on
its files (:mod:`hpsray.bench.disk_bound`: ``disk_bound``; the sparse load's reads/s over it at
``--io-threads`` in flight, ``load_reads_vs_disk_bound``), then ``--repeat`` rounds of cold reads
(sequential bandwidth, raw whole-file reads, full and sparse :meth:`SSDPS.load`), then random
overwrites under background compaction for ``space_ratio``; ``--sweep`` repeats the cold loads
per file size. What each figure counts: docs/benchmarks.md, section "What each bench measures"
(`bench ssd`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from hpsray.bench.disk_bound import delta, load_vs_bound, store_bound
from hpsray.blockio import queue_depth
from hpsray.fileio import drop_cache
from hpsray.tiers.ssd import DEFAULT_FILE_BYTES, SSDPS, default_rows_per_file
from hpsray.tiers.ssd.paramfile import SUFFIX, file_bytes, record_bytes

HELP = "SSD-PS cold load vs sequential read bandwidth, dump throughput, space ratio after compaction"

_MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=float, default=256, help="MiB of live rows (default 256)")
    parser.add_argument("--width", type=int, default=32, help="floats per row (default 32)")
    parser.add_argument(
        "--rows-per-file",
        type=int,
        default=None,
        help=f"rows per parameter file (default: files of about {DEFAULT_FILE_BYTES >> 20} MiB)",
    )
    parser.add_argument("--dump-rows", type=int, default=65536, help="rows per dump call")
    parser.add_argument("--io-threads", type=int, default=4, help="files read concurrently by load")
    parser.add_argument("--overwrites", type=int, default=6, help="overwrite rounds for the space test")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="cold-load / sequential-read pairs; medians are reported (the machine may be shared)",
    )
    parser.add_argument("--dir", default=None, help="directory to work in (default: a temporary one)")
    parser.add_argument("--sweep", action="store_true", help="cold load for several file sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--disk-probe-seconds", type=float, default=2.0, help="seconds of random reads per queue depth (the disk bound)"
    )


def _param_files(directory: str) -> list[str]:
    return [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(SUFFIX)]


def seq_read_bandwidth(directory: str, nbytes: int, chunk: int = 4 * _MiB) -> float:
    """Write ``nbytes`` to a fresh file, drop it from the cache, read it back sequentially."""
    path = os.path.join(directory, "seqread.bin")
    block = np.random.default_rng(1).integers(0, 255, size=chunk, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block.data[: min(chunk, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_cache([path])
    buf = bytearray(chunk)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        total = 0
        while True:
            k = os.readv(fd, [buf])
            total += k
            if k == 0:
                break
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return total / dt


def _fill(store: SSDPS, n_rows: int, width: int, dump_rows: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    keys = rng.permutation(np.arange(1, n_rows + 1, dtype=np.uint64) * np.uint64(0x9E3779B1))
    t0 = time.perf_counter()
    for i in range(0, n_rows, dump_rows):
        k = keys[i : i + dump_rows]
        store.dump(k, np.broadcast_to(k[:, None].astype(np.float32), (k.size, width)))
    return keys, time.perf_counter() - t0


def cold_load(store: SSDPS, keys: np.ndarray) -> dict:
    drop_cache(_param_files(store.directory))
    before = store.stats
    t0 = time.perf_counter()
    rows, found = store.load(keys)
    dt = time.perf_counter() - t0
    after = store.stats
    if not found.all() or not np.array_equal(rows[:, 0], keys.astype(np.float32)):
        raise AssertionError("cold load returned wrong rows")
    nbytes = after["bytes_read"] - before["bytes_read"]
    return {
        "seconds": dt,
        "bytes": nbytes,
        "files": after["files_read"] - before["files_read"],
        "bytes_per_s": nbytes / dt,
        "rows_per_s": keys.size / dt,
        "counts": delta(after, before),
    }


def _warm_up(directory: str) -> None:
    """Load the compiled kernels once, so that no timed phase pays for it."""
    with SSDPS(directory, 4, rows_per_file=16) as s:
        k = np.arange(1, 100, dtype=np.uint64)
        s.dump(k, np.zeros((k.size, 4), np.float32))
        s.dump(k, np.zeros((k.size, 4), np.float32))
        s.load(k)
        s.compact(full=True)
    shutil.rmtree(directory)


def raw_file_read(paths: list[str], threads: int) -> float:
    """Bytes per second reading ``paths`` whole (one read each, ``threads`` at a time) from a
    dropped cache, without checksums or row handling: the ceiling of this I/O pattern."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()

    def read(path: str) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buf = getattr(local, "buf", None)
            if buf is None or buf.size < size:
                buf = local.buf = np.empty(size, np.uint8)
            return os.preadv(fd, [buf[:size].data], 0)
        finally:
            os.close(fd)

    drop_cache(paths)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, sorted(paths)))
    return total / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict:
    width = args.width
    rec = record_bytes(width)
    args.rows_per_file = args.rows_per_file or default_rows_per_file(width)
    n_rows = max(args.rows_per_file, int(args.size * _MiB // rec))
    rng = np.random.default_rng(args.seed)
    base = tempfile.mkdtemp(prefix="hpsray-bench-ssd-", dir=args.dir)
    report: dict = {
        "config": {
            "width": width,
            "rows": n_rows,
            "live_mib": n_rows * rec / _MiB,
            "rows_per_file": args.rows_per_file,
            "file_bytes": file_bytes(args.rows_per_file, width),
            "dump_rows": args.dump_rows,
            "io_threads": args.io_threads,
            "dir": base,
        }
    }
    try:
        _warm_up(os.path.join(base, "warm"))
        d = os.path.join(base, "store")
        store = SSDPS(d, width, rows_per_file=args.rows_per_file, io_threads=args.io_threads)
        keys, dump_s = _fill(store, n_rows, width, args.dump_rows, rng)
        st = store.stats
        report["dump_bytes_per_s"] = st["bytes_written"] / dump_s
        report["dump_rows_per_s"] = n_rows / dump_s
        disk = st["disk_bytes"]
        depth = queue_depth(args.io_threads)  # the reads a load keeps in flight (its ring's, else its threads)
        bound = store_bound(d, width, depth, args.disk_probe_seconds)  # random reads of the store's files
        report["disk_bound"] = bound.to_dict()

        runs = []
        for _ in range(max(1, args.repeat)):  # back to back, so each ratio sees the same machine state
            seq = seq_read_bandwidth(base, disk)
            raw = raw_file_read(_param_files(d), args.io_threads)
            full = cold_load(store, rng.permutation(keys))
            sparse = cold_load(store, rng.choice(keys, max(1, keys.size // 20), replace=False))
            stage = load_vs_bound(sparse["counts"], bound, depth)
            runs.append(
                {
                    "load_reads_vs_disk_bound": stage["load_reads_vs_disk_bound"],
                    "seq_read_bytes_per_s": seq,
                    "raw_file_read_bytes_per_s": raw,
                    "load_bytes_per_s": full["bytes_per_s"],
                    "sparse_load_bytes_per_s": sparse["bytes_per_s"],
                }
            )
        med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        report.update(med)
        report["load_vs_seq_read"] = float(np.median([r["load_bytes_per_s"] / r["seq_read_bytes_per_s"] for r in runs]))
        report["sparse_load_vs_seq_read"] = float(
            np.median([r["sparse_load_bytes_per_s"] / r["seq_read_bytes_per_s"] for r in runs])
        )
        report["raw_file_read_vs_seq_read"] = float(
            np.median([r["raw_file_read_bytes_per_s"] / r["seq_read_bytes_per_s"] for r in runs])
        )
        report["load_reads_vs_disk_bound"] = float(np.median([r["load_reads_vs_disk_bound"] for r in runs]))
        report["load_vs_raw_file_read"] = float(
            np.median([r["load_bytes_per_s"] / r["raw_file_read_bytes_per_s"] for r in runs])
        )
        report["load"] = full
        report["sparse_load_stage"] = stage  # the last run's
        report["runs"] = runs

        ratios = []
        t0 = time.perf_counter()
        for _ in range(args.overwrites):
            sel = rng.permutation(keys)[: keys.size // 3]
            for i in range(0, sel.size, args.dump_rows):
                k = sel[i : i + args.dump_rows]
                store.dump(k, np.broadcast_to(k[:, None].astype(np.float32), (k.size, width)))
                ratios.append(store.stats["space_ratio"])
        store.wait_compaction()
        st = store.stats
        report["space_ratio"] = st["space_ratio"]
        report["space_ratio_max_after_dump"] = max(ratios, default=st["space_ratio"])  # no overwrites: as filled
        report["overwrite_seconds"] = time.perf_counter() - t0
        report["compaction"] = {
            k: st[k]
            for k in (
                "compactions",
                "files_compacted",
                "compaction_bytes_read",
                "compaction_bytes_written",
                "compaction_seconds",
                "backpressure_waits",
                "disk_bytes",
                "live_bytes",
                "files",
            )
        }
        report["checks"] = {
            "load_ge_75pct_seq": report["load_vs_seq_read"] >= 0.75,
            "sparse_load_ge_75pct_seq": report["sparse_load_vs_seq_read"] >= 0.75,
            "space_ratio_le_2": report["space_ratio"] <= 2.0,
        }
        store.close()

        if args.sweep:
            sweep = {}
            n = max(65536, n_rows // 2)
            for mib in (0.25, 1, 4, 16, 64):
                rpf = default_rows_per_file(width, int(mib * _MiB))
                dd = os.path.join(base, f"sweep{rpf}")
                s = SSDPS(dd, width, rows_per_file=rpf, io_threads=args.io_threads)
                k, _ = _fill(s, n, width, max(args.dump_rows, rpf), rng)
                res = []
                for _ in range(max(1, args.repeat)):
                    seq = seq_read_bandwidth(base, s.stats["disk_bytes"])
                    res.append(
                        (
                            seq,
                            cold_load(s, rng.permutation(k))["bytes_per_s"],
                            cold_load(s, rng.choice(k, max(1, k.size // 20), replace=False))["bytes_per_s"],
                            raw_file_read(_param_files(dd), args.io_threads),
                        )
                    )
                sweep[f"{mib:g}MiB"] = {
                    "rows_per_file": rpf,
                    "file_bytes": file_bytes(rpf, width),
                    "load_vs_seq_read": float(np.median([r[1] / r[0] for r in res])),
                    "sparse_load_vs_seq_read": float(np.median([r[2] / r[0] for r in res])),
                    "raw_file_read_vs_seq_read": float(np.median([r[3] / r[0] for r in res])),
                    "seq_read_bytes_per_s": float(np.median([r[0] for r in res])),
                }
                s.close()
                shutil.rmtree(dd)
            report["sweep_file_size"] = sweep
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report
