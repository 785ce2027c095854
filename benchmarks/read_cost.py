"""CPU per random small read on this machine, each way SSD-PS could issue them (issue 47).

    python benchmarks/read_cost.py --file /tmp/big.bin --gib 6 --reads 55000 --json

Writes (once) a file of random bytes, then per round drops it from the page cache and reads
``--reads`` random 512-byte ranges at unaligned offsets (as a row section at ``64 + 16 n``)
each way: ``hinted`` (SSD-PS's: ``POSIX_FADV_WILLNEED`` then ``pread``, 4 threads), ``nowait``
(a failed ``preadv2(RWF_NOWAIT)`` per range first, as ``blockio.read_ranges``), ``pread``
(no hint, 8/16/32 threads), ``dontcache`` (``preadv2(RWF_DONTCACHE)``, Linux >= 6.14, after the
hint) and ``direct`` (``O_DIRECT``, the enclosing 1 KiB, 4/16/32 threads). Reports wall and
process CPU seconds per round and microseconds of CPU per read (the first round is a warm-up).
Run it inside a memory cgroup to count the page cache's reclaim as the bench's 4 GiB limit does.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np
from numba import types as nbt

from hpsray.blockio import hinted_pread_ranges, pread_ranges, read_parallel

_preadv2 = nbt.ExternalFunction("preadv2", nbt.int64(nbt.int32, nbt.uint64, nbt.int32, nbt.int64, nbt.int32))
_fadvise = nbt.ExternalFunction("posix_fadvise", nbt.int32(nbt.int32, nbt.int64, nbt.int64, nbt.int32))
RWF_NOWAIT, RWF_DONTCACHE, WILLNEED = 8, 0x80, 3


@nb.njit(nogil=True)
def _flagged(fds, iov_addr, offsets, lengths, flags, hint, lo, hi):  # pragma: no cover - numba
    if hint:
        for r in range(lo, hi):
            _fadvise(fds[r], offsets[r], lengths[r], WILLNEED)
    short = 0
    for r in range(lo, hi):
        if _preadv2(fds[r], iov_addr + 16 * r, 1, offsets[r], flags) != lengths[r]:
            short += 1
    return short


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _file(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def run(path: str, size: int, n: int, rounds: int, seed: int) -> dict:
    _file(path, size)
    fd = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    pool = ThreadPoolExecutor(32)
    rng = np.random.default_rng(seed)
    modes = ["hinted4", "nowait+hinted4", "pread8", "pread16", "pread32", "dontcache4"]
    modes += ["direct4", "direct16", "direct32"]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(rounds + 1):
        for mode in modes:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offs = np.sort(rng.choice(size // 512 - 4, n, replace=False) * 512 + 80).astype(np.int64)
            unit = 1024 if mode.startswith("direct") else 512
            buf = np.frombuffer(mmap.mmap(-1, n * unit), np.uint8)  # page-aligned, as O_DIRECT needs
            dest = buf.ctypes.data + np.arange(n, dtype=np.int64) * unit
            lens = np.full(n, unit, np.int64)
            fds = np.full(n, direct if mode.startswith("direct") else fd, np.int32)
            iov = np.empty((n, 2), np.uint64)
            iov[:, 0], iov[:, 1] = dest, unit
            threads = int("".join(c for c in mode.split("+")[-1] if c.isdigit()))
            c0, t0 = _cpu(), time.perf_counter()
            if mode.startswith("nowait"):
                _flagged(fds, iov.ctypes.data, offs, lens, RWF_NOWAIT, False, 0, n)
            if "hinted" in mode:
                short = read_parallel(pool, threads, hinted_pread_ranges, (fds, 0, dest, offs, lens), n)
            elif mode.startswith("dontcache"):
                short = read_parallel(pool, threads, _flagged, (fds, iov.ctypes.data, offs, lens, RWF_DONTCACHE, 1), n)
            else:
                aligned = (offs // 512) * 512 if mode.startswith("direct") else offs
                short = read_parallel(pool, threads, pread_ranges, (fds, 0, dest, aligned, lens), n)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
            if short:
                raise SystemExit(f"{mode}: {short} short reads (RWF_DONTCACHE needs Linux >= 6.14)")
            if r:
                times[mode].append((wall, cpu))
    os.close(fd)
    os.close(direct)
    out = {}
    for mode, v in times.items():
        a = np.array(v)
        out[mode] = {
            "wall_s": float(a[:, 0].mean()),
            "cpu_s": float(a[:, 1].mean()),
            "cpu_us_per_read": float(a[:, 1].mean() / n * 1e6),
            "reads_per_s": float(n / a[:, 0].mean()),
        }
    return {"reads": n, "file_bytes": size, "rounds": rounds, "load_average": os.getloadavg()[0], "modes": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", default="/tmp/hpsray-read-cost.bin")
    p.add_argument("--gib", type=float, default=6.0)
    p.add_argument("--reads", type=int, default=55000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    res = run(a.file, int(a.gib * (1 << 30)) // (64 << 20) * (64 << 20), a.reads, a.rounds, a.seed)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    for mode, m in res["modes"].items():
        print(f"{mode:16s} wall {m['wall_s']:.3f} s  cpu {m['cpu_s']:.3f} s  {m['cpu_us_per_read']:.1f} us/read")


if __name__ == "__main__":
    main()
