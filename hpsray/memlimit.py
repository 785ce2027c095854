"""The memory this process may use: the machine's, or its memory cgroup's limit where lower (Ray-free)."""

from __future__ import annotations

import os

__all__ = ["memory_limit"]


def memory_limit() -> tuple[int, str]:
    """``(bytes, where from)``: the memory this process and the processes it starts may use —
    the machine's ``MemTotal`` or, when lower, the limit of its memory cgroup (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``)."""
    total, where = _meminfo_total(), "MemTotal in /proc/meminfo"
    for path in _cgroup_limit_files():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, where = int(text), path
    return total, where


def _meminfo_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_limit_files() -> list[str]:
    """The memory limit files of this process's cgroup and its ancestors (a parent's limit binds too)."""
    out: list[str] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            out.append(os.path.join(root, *parts[:i], name))
    return out
