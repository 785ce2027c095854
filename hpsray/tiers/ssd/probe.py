"""The disk's random-read bound: what the device under SSD-PS can read at random, per queue depth.

:func:`probe` reads random page-aligned ranges of ``read_bytes`` from real files (a store's own
parameter files, or :func:`scratch_file`) for a few seconds per queue depth, ``depth`` reads in
flight: from one io_uring ring (:class:`hpsray.uring.Ring`, as SSD-PS loads issue them) where the
kernel gives one, else from ``depth`` threads each issuing one ``pread`` at a time from a numba loop
that holds no GIL (:func:`hpsray.blockio.pread_ranges`). On this machine's 2 cores threads reached
59k reads/s at depth 128 where one ring read 136k/s of the same file (docs/benchmarks.md, "io_uring
reads"): the ring's rate is the disk's, the threads' is their CPU. Reads bypass the page cache
(``O_DIRECT``, page-aligned buffers from ``mmap``); where the file system refuses ``O_DIRECT``
(tmpfs) the files are dropped from the cache (``POSIX_FADV_DONTNEED``) before each depth and read
through it, and the result says so (``direct`` false: a bound of the cache, not of a disk).
:class:`DiskCounters` reads the device's own counters (``/proc/diskstats``) around a run: reads
completed, bytes, and the mean reads in flight (the device's milliseconds reading over the wall's,
Little's law); they count every process's reads of that device.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hpsray import uring
from hpsray.blockio import STAGE_BYTES, pread_ranges

__all__ = ["DEPTHS", "PAGE", "DiskBound", "DiskCounters", "probe", "read_size", "scratch_file"]

DEPTHS = (1, 8, 32)
PAGE = 4096  # the unit the page cache (and O_DIRECT's alignment) reads in
_BATCH = 32  # reads per numba call of one thread (the clock is checked between calls)


def read_size(nbytes: int) -> int:
    """The bytes a device read of ``nbytes`` at a page boundary takes: whole pages."""
    return max(PAGE, -(-int(nbytes) // PAGE) * PAGE)


@dataclass(frozen=True)
class DiskBound:
    """Random reads of ``read_bytes`` per second (``reads_per_s``) and bytes per second
    (``bytes_per_s``) per queue depth; ``direct``: read past the page cache; ``span_bytes``: the
    bytes of the files read at random; ``note``: how it was measured where not ``O_DIRECT``."""

    read_bytes: int
    direct: bool
    span_bytes: int
    files: int
    reads_per_s: dict[int, float]
    bytes_per_s: dict[int, float]
    reads: dict[int, int]
    seconds: dict[int, float]
    load_average: float
    note: str = ""
    measured_at: str = ""
    extra: dict = field(default_factory=dict)

    def at(self, depth: int) -> float:
        """Reads per second at ``depth`` in flight: the measured depth, else interpolated
        linearly between the two measured depths around it (clamped to the ends)."""
        ds = sorted(self.reads_per_s)
        if depth in self.reads_per_s:
            return self.reads_per_s[depth]
        if depth <= ds[0]:
            return self.reads_per_s[ds[0]]
        if depth >= ds[-1]:
            return self.reads_per_s[ds[-1]]
        hi = next(d for d in ds if d > depth)
        lo = max(d for d in ds if d < depth)
        w = (depth - lo) / (hi - lo)
        return (1 - w) * self.reads_per_s[lo] + w * self.reads_per_s[hi]

    def to_dict(self) -> dict:
        return {
            "read_bytes": self.read_bytes,
            "direct": self.direct,
            "span_bytes": self.span_bytes,
            "files": self.files,
            "by_depth": {
                str(d): {
                    "reads_per_s": self.reads_per_s[d],
                    "bytes_per_s": self.bytes_per_s[d],
                    "reads": self.reads[d],
                    "seconds": self.seconds[d],
                }
                for d in sorted(self.reads_per_s)
            },
            "load_average": self.load_average,
            "note": self.note,
            "measured_at": self.measured_at,
            **self.extra,
        }


def scratch_file(directory: str, nbytes: int, name: str = "hpsray-disk-probe.bin") -> str:
    """Write ``nbytes`` of random bytes (fsynced: real extents, not holes) to a new file in
    ``directory``; returns its path (the caller removes it)."""
    path = os.path.join(directory, name)
    chunk = np.random.default_rng(0).integers(0, 256, size=min(nbytes, 4 << 20), dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk.data[: min(chunk.size, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _open(paths: list[str], read_bytes: int) -> tuple[list[int], bool, str]:
    """Descriptors of ``paths`` opened ``O_DIRECT`` (checked with one aligned read), or plain
    ones and a note when the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        fds: list[int] = []
        buf = mmap.mmap(-1, read_bytes)
        try:
            for p in paths:
                fds.append(os.open(p, os.O_RDONLY | flag))
            os.preadv(fds[0], [buf], 0)
            return fds, True, ""
        except OSError as e:
            for fd in fds:
                os.close(fd)
            why = f"O_DIRECT refused ({e.strerror or e})"
        finally:
            buf.close()
    else:
        why = "O_DIRECT not available on this platform"
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    return fds, False, why + ": buffered preads after POSIX_FADV_DONTNEED (a bound of the cache, not a disk)"


def probe(
    paths: list[str],
    read_bytes: int,
    depths: tuple[int, ...] = DEPTHS,
    seconds: float = 2.0,
    max_reads: int | None = None,
    seed: int = 0,
) -> DiskBound:
    """Random reads of ``read_size(read_bytes)`` bytes at page-aligned offsets of ``paths``
    (files chosen in proportion to their size), ``d`` in flight for each depth ``d``, for
    ``seconds`` per depth or ``max_reads`` reads, whichever ends first. Raises ``ValueError``
    when no file holds one read."""
    size = read_size(read_bytes)
    sizes = [os.path.getsize(p) for p in paths]
    keep = [(p, s) for p, s in zip(paths, sizes) if s >= size]
    if not keep:
        raise ValueError(f"disk probe: no file of {len(paths)} holds a read of {size} bytes")
    paths = [p for p, _ in keep]
    pages = np.array([(s - size) // PAGE + 1 for _, s in keep], np.int64)  # start pages per file
    weights = pages / pages.sum()
    fds, direct, note = _open(paths, size)
    load0 = os.getloadavg()[0]
    rates: dict[int, float] = {}
    bps: dict[int, float] = {}
    counts: dict[int, int] = {}
    secs: dict[int, float] = {}
    try:
        for depth in depths:
            if not direct:
                for fd in fds:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            at = np.asarray(fds, np.int32)
            n, dt, issued_by = _at_depth(at, pages, weights, size, depth, seconds, max_reads, seed)
            counts[depth], secs[depth] = n, dt
            rates[depth] = n / dt
            bps[depth] = n * size / dt
    finally:
        for fd in fds:
            os.close(fd)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return DiskBound(
        read_bytes=size,
        direct=direct,
        span_bytes=int(sum(s for _, s in keep)),
        files=len(keep),
        reads_per_s=rates,
        bytes_per_s=bps,
        reads=counts,
        seconds=secs,
        load_average=max(load0, os.getloadavg()[0]),
        note=note,
        measured_at=when,
        extra={"issued_by": issued_by},
    )


def _at_depth(
    fds: np.ndarray,
    pages: np.ndarray,
    weights: np.ndarray,
    size: int,
    depth: int,
    seconds: float,
    max_reads: int | None,
    seed: int,
) -> tuple[int, float, str]:
    """The reads done and the seconds they took at ``depth`` in flight, and what issued them
    (``"io_uring"``, else ``"threads"``). Raises ``OSError`` on a short read."""
    try:
        ring = uring.Ring(max(8, 2 * depth))
    except OSError:
        return (*_at_depth_threads(fds, pages, weights, size, depth, seconds, max_reads, seed), "threads")
    try:
        return (*_at_depth_ring(ring, fds, pages, weights, size, depth, seconds, max_reads, seed), "io_uring")
    finally:
        ring.close()


def _at_depth_ring(
    ring: uring.Ring,
    fds: np.ndarray,
    pages: np.ndarray,
    weights: np.ndarray,
    size: int,
    depth: int,
    seconds: float,
    max_reads: int | None,
    seed: int,
) -> tuple[int, float]:
    """``ring`` reading random pages of ``fds`` as :func:`_at_depth_threads` does, ``depth`` in
    flight, in calls of many reads (each call drains the ring once at its end), into the ring's
    bounce buffer as loads' direct reads do (:func:`hpsray.blockio.ring_read`)."""
    rng = np.random.default_rng((seed, depth))
    per_call = max(64 * depth, 1024)
    # buffers reused round-robin (reads in flight never share one), in about a load's bounce buffer
    slots = max(depth, min(per_call, 4096, STAGE_BYTES // size))
    stage = ring.staging(size * slots)
    done = 0
    dest = stage + (np.arange(per_call, dtype=np.int64) % slots) * size
    lengths = np.full(per_call, size, np.int64)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline and (max_reads is None or done < max_reads):
        n = per_call if max_reads is None else min(per_call, max_reads - done)
        f = rng.choice(fds.size, size=n, p=weights)
        offs = (rng.random(n) * pages[f]).astype(np.int64) * PAGE
        got = ring.read(fds[f], dest[:n], offs, lengths[:n], depth=depth, staged=True)
        if (got != size).any():
            short = int((got != size).sum())
            raise OSError(f"disk probe: {short} reads of {size} bytes came back short (depth {depth})")
        done += n
    return done, time.perf_counter() - t0


def _at_depth_threads(
    fds: np.ndarray,
    pages: np.ndarray,
    weights: np.ndarray,
    size: int,
    depth: int,
    seconds: float,
    max_reads: int | None,
    seed: int,
) -> tuple[int, float]:
    """``depth`` threads reading random pages of ``fds`` (file ``i`` chosen with ``weights[i]``,
    its first ``pages[i]`` pages) until ``seconds`` pass or ``max_reads`` are done; returns
    the reads and the seconds. Raises ``OSError`` on a short read."""
    done = [0] * depth
    lock = threading.Lock()
    issued = [0]
    deadline = time.perf_counter() + seconds

    def worker(w: int) -> int:
        rng = np.random.default_rng((seed, depth, w))
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        view = np.frombuffer(buf, np.uint8)
        dest = np.zeros(_BATCH, np.int64)
        lengths = np.full(_BATCH, size, np.int64)
        short = 0
        try:
            while time.perf_counter() < deadline:
                n = _BATCH
                if max_reads is not None:
                    with lock:
                        n = min(_BATCH, max_reads - issued[0])
                        issued[0] += max(n, 0)
                    if n <= 0:
                        break
                f = rng.choice(fds.size, size=n, p=weights)
                offs = (rng.random(n) * pages[f]).astype(np.int64) * PAGE
                short += pread_ranges(fds[f], view.ctypes.data, dest[:n], offs, lengths[:n], 0, n)
                done[w] += n
        finally:
            del view
            buf.close()
        return short

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as ex:
        short = sum(ex.map(worker, range(depth)))
    dt = time.perf_counter() - t0
    if short:
        raise OSError(f"disk probe: {short} reads of {size} bytes came back short (depth {depth})")
    return sum(done), dt


@dataclass(frozen=True)
class DiskCounters:
    """The device counters of the disk holding a path (``/proc/diskstats``) at one moment."""

    device: str
    reads: int
    sectors: int
    read_ms: int
    wall: float

    @staticmethod
    def of(path: str) -> DiskCounters | None:
        """The counters of ``path``'s device, or ``None`` (no ``/proc/diskstats``, no such device:
        a file system without one, e.g. tmpfs or overlay)."""
        st = os.stat(path)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    p = line.split()
                    if len(p) >= 14 and int(p[0]) == major and int(p[1]) == minor:
                        return DiskCounters(p[2], int(p[3]), int(p[5]), int(p[6]), time.perf_counter())
        except OSError:
            return None
        return None

    def since(self, before: DiskCounters) -> dict:
        """Reads, bytes (512-byte sectors), bytes per read and mean reads in flight between
        ``before`` and this moment."""
        wall = max(self.wall - before.wall, 1e-9)
        reads = self.reads - before.reads
        nbytes = 512 * (self.sectors - before.sectors)
        return {
            "device": self.device,
            "reads": reads,
            "bytes": nbytes,
            "bytes_per_read": nbytes / reads if reads else 0.0,
            "reads_per_s": reads / wall,
            "bytes_per_s": nbytes / wall,
            "mean_reads_in_flight": (self.read_ms - before.read_ms) / (1000.0 * wall),
            "seconds": wall,
        }
