"""Reads through an io_uring ring (``hpsray.uring``) and ``read_ranges`` over it: the bytes equal
``pread``'s, direct and buffered, in one fill of the bounce buffer or many, its buffer registered
(``READ_FIXED``) or not; a short range and a
failed ring fall back to ``pread``; the ring is made unless ``HPSRAY_IO_URING=0``; a store larger
than its share of memory reads past the page cache, a smaller one through it."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hpsray import blockio, uring
from hpsray.blockio import read_ranges
from hpsray.fileio import drop_cache

SIZE = 1 << 20


def _ring_works() -> bool:
    try:
        uring.Ring().close()
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _ring_works(), reason="this kernel gives no io_uring ring")


@pytest.fixture(autouse=True)
def ring_on(monkeypatch):
    monkeypatch.setenv("HPSRAY_IO_URING", "1")  # read by each new thread's first thread_ring()


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a new thread, which starts without a ring (rings are per thread)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def files(directory, n: int = 3) -> tuple[list[int], list[bytes]]:
    datas, fds = [], []
    for i in range(n):
        path = os.path.join(directory, f"f{i}")
        d = np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            f.write(d)
        drop_cache([path])
        datas.append(d)
        fds.append(os.open(path, os.O_RDONLY))
    return fds, datas


def ranges(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` ranges sorted by file and offset, lengths 0 to 9,000, the last one past its file's end."""
    rng = np.random.default_rng(seed)
    f = np.sort(rng.integers(0, 3, n))
    off = rng.integers(0, SIZE - 9000, n)
    order = np.lexsort((off, f))
    f, off = f[order], off[order]
    length = rng.integers(0, 9000, n)
    length[: n // 10] = 0
    rng.shuffle(length)
    off[-1], length[-1] = SIZE - 100, 300
    at = np.zeros(n + 1, np.int64)
    np.cumsum(length, out=at[1:])
    return f, off, length, at


def expect(datas, f, off, length) -> list[bytes]:
    return [datas[f[r]][off[r] : off[r] + length[r]] for r in range(f.size)]


@pytest.mark.parametrize(
    ("where", "direct", "registered"),
    [("disk", True, True), ("disk", True, False), ("disk", False, True), ("tmpfs", True, True)],
)
def test_ring_reads_equal_pread_direct_and_buffered(tmp_path, where, direct, registered, monkeypatch):
    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        directory = os.path.join("/dev/shm", f"hpsray-uring-{os.getpid()}")
        os.makedirs(directory)
    else:
        directory = str(tmp_path)
    monkeypatch.setattr(blockio, "STAGE_BYTES", 64 << 10)  # many fills of the bounce buffer per call
    if not registered:  # a kernel that refuses to pin the bounce buffer (memlock): plain reads into it
        monkeypatch.setattr(uring.Ring, "_register", lambda self, buf: setattr(self, "fixed", False))
    fds, datas = files(directory)
    try:
        f, off, length, at = ranges(2000, seed=3)
        out = np.zeros(int(at[-1]), np.uint8)

        def go() -> tuple[int, int, int, bool, bool]:
            fd, dest = np.asarray(fds)[f], at[:-1] + out.ctypes.data
            short, copied, ringed = read_ranges(None, 1, fd, dest, off, length, direct=direct)
            ring = uring.thread_ring()
            return short, copied, ringed, ring is not None, ring is not None and ring.fixed

        short, copied, ringed, kept, fixed = in_thread(go)
        # only the range past the end is short (read again by pread); the ring read the rest
        assert (short, copied, ringed, kept) == (1, 0, f.size - 1, True)
        if direct and where == "disk" and os.geteuid() == 0:  # root may pin: reads into the bounce buffer are fixed
            assert fixed == registered
        want = expect(datas, f, off, length)
        got = [out[at[r] : at[r + 1]].tobytes() for r in range(f.size)]
        assert got[:-1] == want[:-1] and got[-1][:100] == want[-1]

        ring = uring.Ring()  # the ring alone, buffered: each read's own count of bytes
        try:
            res = ring.read(np.asarray(fds)[f], at[:-1] + out.ctypes.data, off, length, depth=7)
        finally:
            ring.close()
        assert res[:-1].tolist() == length[:-1].tolist() and res[-1] == 100
    finally:
        for fd in fds:
            os.close(fd)
        if where == "tmpfs":
            for name in os.listdir(directory):
                os.unlink(os.path.join(directory, name))
            os.rmdir(directory)


def test_a_failed_ring_is_dropped_and_the_reads_fall_back_to_pread(tmp_path):
    fds, datas = files(str(tmp_path))
    try:
        f, off, length, at = ranges(500, seed=5)
        out = np.zeros(int(at[-1]), np.uint8)

        def go() -> tuple[int, int, bool]:
            ring = uring.thread_ring()
            assert ring is not None
            os.close(ring.fd)  # the fault: every enter now fails
            ring.fd = os.open(os.devnull, os.O_RDONLY)  # a descriptor the ring's close may close
            short, _, ringed = read_ranges(None, 1, np.asarray(fds)[f], at[:-1] + out.ctypes.data, off, length)
            return short, ringed, uring.thread_ring() is None

        assert in_thread(go) == (1, 0, True)
        got = [out[at[r] : at[r + 1]].tobytes() for r in range(f.size)]
        assert got[:-1] == expect(datas, f, off, length)[:-1]
    finally:
        for fd in fds:
            os.close(fd)


def test_a_closed_ring_raises_and_the_ring_is_on_unless_turned_off(tmp_path, monkeypatch):
    fds, _ = files(str(tmp_path), 1)
    ring = uring.Ring()
    real = ring.fd
    ring.fd = os.open(os.devnull, os.O_RDONLY)  # not a ring: io_uring_enter fails
    buf = np.zeros(64, np.uint8)
    try:
        with pytest.raises(OSError, match="io_uring_enter"):
            ring.read(np.asarray(fds), np.asarray([buf.ctypes.data]), np.asarray([0]), np.asarray([64]))
    finally:
        os.close(ring.fd)
        ring.fd = real
        ring.close()
        os.close(fds[0])
    assert in_thread(lambda: blockio.queue_depth(6)) == uring.DEPTH
    monkeypatch.delenv("HPSRAY_IO_URING")  # on by default
    assert in_thread(lambda: blockio.queue_depth(6)) == uring.DEPTH
    monkeypatch.setenv("HPSRAY_IO_URING", "0")
    assert in_thread(uring.thread_ring) is None
    assert in_thread(lambda: blockio.queue_depth(6)) == 6


@pytest.mark.parametrize("share", [0.0, None])
def test_a_store_larger_than_its_share_of_memory_reads_past_the_page_cache(tmp_path, share, monkeypatch):
    from hpsray.tiers.ssd import SSDPS
    from hpsray.tiers.ssd import reads as ssd_reads

    if share is not None:  # every store is "larger" than 0 bytes: read O_DIRECT
        monkeypatch.setattr(ssd_reads, "DIRECT_SHARE", share)
    width, rpf = 32, 64 * 8
    keys = np.arange(1, 12 * rpf + 1, dtype=np.uint64)
    rows = np.repeat(keys[:, None].astype(np.float32), width, axis=1)
    want = keys[::40]  # a few blocks of every file: partial loads
    with SSDPS(tmp_path / "s", width, rows_per_file=rpf, background=False) as s:
        for part in np.array_split(np.arange(keys.size), 12):
            s.dump(keys[part], rows[part])
    with SSDPS(tmp_path / "s", background=False) as s:
        drop_cache(str(p) for p in (tmp_path / "s").iterdir())

        def twice() -> list[dict]:
            out = []
            for _ in range(2):
                before = s.stats
                got, found = s.load(want)
                assert found.all() and np.array_equal(got, rows[want - 1])
                out.append({k: s.stats[k] - before[k] for k in ("reads_issued", "reads_mapped", "reads_ring")})
            return out

        cold, again = in_thread(twice)
    assert cold["reads_mapped"] == 0 and cold["reads_ring"] == cold["reads_issued"] > 0
    if share is not None:  # nothing was left in the page cache: the ring reads every range again
        assert again["reads_mapped"] == 0 and again["reads_ring"] == again["reads_issued"]
    else:  # read through the page cache: the second load copies every range from the mappings
        assert again["reads_mapped"] == again["reads_issued"] and again["reads_ring"] == 0


def test_resident_ranges_copied_apart_are_not_read_again(tmp_path):
    """``copy_resident`` (what a load's own thread runs while the fetch thread reads the round
    before) copies the ranges whose pages are resident; ``read_ranges`` given its result reads
    only the others, and every byte lands."""
    fds, datas = files(str(tmp_path), 1)
    fd = fds[0]
    try:
        os.fsync(fd)  # clean pages, so that they can be dropped
        drop_cache([tmp_path / "f0"])
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what is read next
        os.pread(fd, SIZE // 2, 0)  # the first half resident, the second half not
        m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        base = np.frombuffer(m, np.uint8).ctypes.data
        n = 64
        off = np.linspace(0, SIZE - 4096, n).astype(np.int64) // 4096 * 4096 + 100
        length = np.full(n, 1000, np.int64)
        out = np.zeros(n * 1000, np.uint8)
        dest = out.ctypes.data + np.arange(n, dtype=np.int64) * 1000
        mapped = (np.full(n, base, np.uint64), np.full(n, SIZE, np.int64))
        done, copied = blockio.copy_resident(dest, off, length, mapped)
        if (done == 1).all():
            pytest.skip("this file system keeps the dropped pages resident (tmpfs)")
        first_half = off + length <= SIZE // 2
        assert copied == int(first_half.sum()) > 0 and (done[first_half] == 1).all() and (done[~first_half] == 2).all()
        short, copied_again, ringed = in_thread(
            lambda: read_ranges(None, 1, np.full(n, fd, np.int32), dest, off, length, resident=(done, copied))
        )
        assert short == 0 and copied_again == copied and ringed == n - copied
        got = [out[r * 1000 : (r + 1) * 1000].tobytes() for r in range(n)]
        assert got == expect(datas, np.zeros(n, int), off, length)
        m.close()
    finally:
        os.close(fd)
