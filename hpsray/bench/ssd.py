"""``hpsray bench ssd``: SSD-PS dump / cold load throughput and space after compaction.

In one run, on the same file system:

1. **dump** — write ``--size`` MiB of rows with :meth:`SSDPS.dump` (fsync, rename, manifest
   record per call): ``dump_bytes_per_s``.
2. **baseline** — write one plain file as large as all parameter files together, drop it from
   the page cache (``posix_fadvise(DONTNEED)``) and read it sequentially in 4 MiB reads:
   ``seq_read_bytes_per_s``, the machine's sequential read bandwidth.
3. **cold load** — drop the parameter files from the page cache, then load every key (in
   random order, one call): each file is read whole once; ``load_bytes_per_s`` counts file
   bytes read per second, checksums verified. Also a sparse load of a random 5 % of the keys.
4. **space** — overwrite random thirds of the keys several times with background compaction
   on; ``space_ratio`` = disk bytes / live bytes once compaction is idle, plus the worst ratio
   seen after any dump.

``--sweep`` repeats the cold load for several rows-per-file values (how the default was chosen).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from hpsray.tiers.paramfile import SUFFIX, file_bytes, record_bytes
from hpsray.tiers.ssd import DEFAULT_ROWS_PER_FILE, SSDPS

HELP = "SSD-PS cold load vs sequential read bandwidth, dump throughput, space ratio after compaction"

_MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=float, default=256, help="MiB of live rows (default 256)")
    parser.add_argument("--width", type=int, default=32, help="floats per row (default 32)")
    parser.add_argument("--rows-per-file", type=int, default=DEFAULT_ROWS_PER_FILE)
    parser.add_argument("--dump-rows", type=int, default=65536, help="rows per dump call")
    parser.add_argument("--io-threads", type=int, default=4, help="files read concurrently by load")
    parser.add_argument("--overwrites", type=int, default=6, help="overwrite rounds for the space test")
    parser.add_argument("--repeat", type=int, default=3,
                        help="cold-load / sequential-read pairs; medians are reported (the machine may be shared)")
    parser.add_argument("--dir", default=None, help="directory to work in (default: a temporary one)")
    parser.add_argument("--sweep", action="store_true", help="cold load for several rows-per-file values")
    parser.add_argument("--seed", type=int, default=0)


def drop_cache(paths: list[str]) -> None:
    """Evict files from the page cache (they must be clean: written and fsynced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
            left -= os.write(fd, memoryview(block)[: min(chunk, left)])
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
    return dict(seconds=dt, bytes=nbytes, files=after["files_read"] - before["files_read"],
                bytes_per_s=nbytes / dt, rows_per_s=keys.size / dt)


def _warm_up(directory: str) -> None:
    """Load the compiled kernels once, so that no timed phase pays for it."""
    with SSDPS(directory, 4, rows_per_file=16) as s:
        k = np.arange(1, 100, dtype=np.uint64)
        s.dump(k, np.zeros((k.size, 4), np.float32))
        s.dump(k, np.zeros((k.size, 4), np.float32))
        s.load(k)
        s.compact(full=True)
    shutil.rmtree(directory)


def run(args: argparse.Namespace) -> dict:
    width = args.width
    rec = record_bytes(width)
    n_rows = max(args.rows_per_file, int(args.size * _MiB // rec))
    rng = np.random.default_rng(args.seed)
    base = tempfile.mkdtemp(prefix="hpsray-bench-ssd-", dir=args.dir)
    report: dict = dict(config=dict(width=width, rows=n_rows, live_mib=n_rows * rec / _MiB,
                                    rows_per_file=args.rows_per_file,
                                    file_bytes=file_bytes(args.rows_per_file, width),
                                    dump_rows=args.dump_rows, io_threads=args.io_threads, dir=base))
    try:
        _warm_up(os.path.join(base, "warm"))
        d = os.path.join(base, "store")
        store = SSDPS(d, width, rows_per_file=args.rows_per_file, io_threads=args.io_threads)
        keys, dump_s = _fill(store, n_rows, width, args.dump_rows, rng)
        st = store.stats
        report["dump_bytes_per_s"] = st["bytes_written"] / dump_s
        report["dump_rows_per_s"] = n_rows / dump_s
        disk = st["disk_bytes"]

        pairs = []
        for _ in range(max(1, args.repeat)):  # back to back, so each ratio sees the same machine state
            seq = seq_read_bandwidth(base, disk)
            cl = cold_load(store, rng.permutation(keys))
            pairs.append((seq, cl))
        report["seq_read_bytes_per_s"] = float(np.median([p[0] for p in pairs]))
        report["load_bytes_per_s"] = float(np.median([p[1]["bytes_per_s"] for p in pairs]))
        report["load_vs_seq_read"] = float(np.median([p[1]["bytes_per_s"] / p[0] for p in pairs]))
        report["load"] = pairs[len(pairs) // 2][1]
        report["load_runs"] = [dict(seq_read_bytes_per_s=p[0], load_bytes_per_s=p[1]["bytes_per_s"]) for p in pairs]
        sparse = cold_load(store, rng.choice(keys, max(1, keys.size // 20), replace=False))
        report["sparse_load_5pct"] = sparse

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
        report["space_ratio_max_after_dump"] = max(ratios)
        report["overwrite_seconds"] = time.perf_counter() - t0
        report["compaction"] = {k: st[k] for k in (
            "compactions", "files_compacted", "compaction_bytes_read", "compaction_bytes_written",
            "compaction_seconds", "backpressure_waits", "disk_bytes", "live_bytes", "files")}
        report["checks"] = dict(load_ge_75pct_seq=report["load_vs_seq_read"] >= 0.75,
                                space_ratio_le_2=report["space_ratio"] <= 2.0)
        store.close()

        if args.sweep:
            sweep = {}
            n = max(65536, n_rows // 2)
            for rpf in (1024, 4096, 8192, 16384, 65536):
                dd = os.path.join(base, f"sweep{rpf}")
                s = SSDPS(dd, width, rows_per_file=rpf, io_threads=args.io_threads)
                k, _ = _fill(s, n, width, max(args.dump_rows, rpf), rng)
                seq = seq_read_bandwidth(base, s.stats["disk_bytes"])
                r = cold_load(s, rng.permutation(k))
                sweep[str(rpf)] = dict(file_bytes=file_bytes(rpf, width), load_bytes_per_s=r["bytes_per_s"],
                                       seq_read_bytes_per_s=seq, ratio=r["bytes_per_s"] / seq)
                s.close()
                shutil.rmtree(dd)
            report["sweep_rows_per_file"] = sweep
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report
