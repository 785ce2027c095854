"""Which node owns a key and which of the node's devices holds it (docs/architecture.md: Keys and partitioning).

``h = mix64(key)``; owner node ``= h % N``; device ``= (h // N) % D``. The device uses the
quotient, not the same low bits again: with ``key % 2`` for both, node 0 would only ever
see even keys and all of them would land on its device 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from hpsray.kernels.arrays import array_module, is_device_array
from hpsray.kernels.hashing import mix64_array
from hpsray.kernels.table import as_keys


def _check(n: int, name: str) -> int:
    if int(n) < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return int(n)


def key_hash(keys: ArrayLike) -> np.ndarray:
    """The partitioning hash ``mix64(key)`` of each key (``uint64``)."""
    return mix64_array(as_keys(keys))


def owner_of(keys: ArrayLike, n_nodes: int) -> np.ndarray:
    """Owner node of each key, ``int64`` in ``[0, n_nodes)``."""
    n = np.uint64(_check(n_nodes, "n_nodes"))
    return (key_hash(keys) % n).astype(np.int64)


def device_of(keys: ArrayLike, n_nodes: int, n_devices: int) -> np.ndarray:
    """Device (within its owner node) of each key, ``int64`` in ``[0, n_devices)``; device
    arrays (CuPy) in, device arrays out, computed on the device."""
    n = np.uint64(_check(n_nodes, "n_nodes"))
    d = np.uint64(_check(n_devices, "n_devices"))
    h = mix64_array(keys) if is_device_array(keys) else key_hash(keys)  # type: ignore[arg-type]
    return ((h // n) % d).astype(np.int64)


@dataclass(frozen=True)
class Routing:
    """One mini-batch's exchange among a node's devices, known on the host before it runs:
    ``keys[order]`` groups a device's keys by the device that holds them (``counts[e]`` go to
    device ``e``), and ``got[e]`` keys come to it from device ``e``. ``order`` is in the keys'
    array module."""

    order: Any
    counts: list[int]
    got: list[int]


def routing(keys: np.ndarray, to_me: list[int], n_nodes: int, n_devices: int) -> Routing:
    """The :class:`Routing` of host ``keys`` (a device's, distinct) given ``to_me[e]``: how many
    keys device ``e`` sends this one (known wherever every device's keys are)."""
    order, offsets = group_by(device_of(keys, n_nodes, n_devices), n_devices)
    return Routing(order, [int(c) for c in np.diff(offsets)], [int(c) for c in to_me])


def place(keys: ArrayLike, n_nodes: int, n_devices: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(owner node, device)`` of each key, hashing once."""
    n = np.uint64(_check(n_nodes, "n_nodes"))
    d = np.uint64(_check(n_devices, "n_devices"))
    h = key_hash(keys)
    return (h % n).astype(np.int64), ((h // n) % d).astype(np.int64)


def group_by(parts: np.ndarray, n_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Group positions by part id: ``(order, offsets)`` such that
    ``order[offsets[p]:offsets[p + 1]]`` are the positions with ``parts == p``, in input order."""
    if is_device_array(parts):  # CuPy: its sort is stable
        xp = array_module("cuda")
        offsets = xp.zeros(n_parts + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(xp.bincount(parts, minlength=n_parts))
        return xp.argsort(parts), offsets
    parts = np.asarray(parts, dtype=np.int64)
    order = np.argsort(parts, kind="stable")
    offsets = np.zeros(n_parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=n_parts), out=offsets[1:])
    return order, offsets


@dataclass(frozen=True)
class Partitioner:
    """Key placement for a cluster of ``n_nodes`` nodes with ``n_devices`` devices each."""

    n_nodes: int
    n_devices: int = 1

    def __post_init__(self) -> None:
        _check(self.n_nodes, "n_nodes")
        _check(self.n_devices, "n_devices")

    def owner(self, keys: ArrayLike) -> np.ndarray:
        """Owner node of each key."""
        return owner_of(keys, self.n_nodes)

    def device(self, keys: ArrayLike) -> np.ndarray:
        """Device of each key within its owner node."""
        return device_of(keys, self.n_nodes, self.n_devices)

    def place(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(owner, device)`` of each key."""
        return place(keys, self.n_nodes, self.n_devices)

    def split_by_owner(self, keys: ArrayLike) -> list[np.ndarray]:
        """The keys owned by each node, in input order (a list of ``n_nodes`` arrays)."""
        keys = as_keys(keys)
        order, offsets = group_by(self.owner(keys), self.n_nodes)
        return [keys[order[offsets[i] : offsets[i + 1]]] for i in range(self.n_nodes)]

    def split_by_device(self, keys: ArrayLike) -> list[np.ndarray]:
        """Keys of one node split over its devices (a list of ``n_devices`` arrays)."""
        keys = as_keys(keys)
        order, offsets = group_by(self.device(keys), self.n_devices)
        return [keys[order[offsets[i] : offsets[i + 1]]] for i in range(self.n_devices)]
