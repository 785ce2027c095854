"""A memory cgroup of its own (v1 or v2) for a benchmark's processes, and a sampler of its
resident memory and a directory's bytes on disk (``hpsray bench bigger-than-memory``)."""

from __future__ import annotations

import os
import threading
import time


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
                self.peak_disk = max(self.peak_disk, dir_bytes(self.directory))
            self._stop.wait(self.period)

    def __enter__(self) -> Monitor:
        self.cgroup.reset_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def dir_bytes(directory: str) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
