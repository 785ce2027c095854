"""The device mesh: every device process of every node, ``D`` per node (docs/architecture.md:
Devices).

Three kinds of ``torch.distributed`` group (``gloo`` on CPU, ``nccl`` on GPU), formed at once by
every process: **world** (rank ``node * D + device``: the dense sum, the "inputs ok" flag),
**node** (its ``D`` processes: :meth:`DeviceMesh.lookup` and :meth:`DeviceMesh.route`, all-to-all)
and **peers** (one device index on every node, ``N > 1``: :meth:`DeviceMesh.allgather_sparse`).
Received parts are concatenated in rank order (bit-equal copies). The rendezvous and every
operation end within ``timeout_s`` in :class:`~hpsray.errors.FaultTimeout`. A process is in at
most one mesh, and uses either it or :class:`~hpsray.cluster.collective.CollectiveGroup`.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from hpsray.cluster import faults
from hpsray.cluster.netaddr import bind_collectives, node_address
from hpsray.kernels.arrays import array_module, is_device_array, to_host
from hpsray.tiers.partition import device_of, group_by

__all__ = ["DeviceMesh", "rendezvous_address"]


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_FIRST_PORT = 20000  # above Ray's worker ports (10002-19999 by default)


def _outside_ephemeral() -> range:
    """Ports the kernel never hands out by itself (below its ephemeral range, above Ray's):
    one found free there stays free until a process binds it by number."""
    try:
        with open(_EPHEMERAL) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(_FIRST_PORT, max(low, _FIRST_PORT))


def _bindable(ip: str, port: int) -> int | None:
    """``port`` (the kernel's choice when 0) if ``ip:port`` can be bound now, else ``None``."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def rendezvous_address() -> str:
    """``tcp://ip:port`` for rank 0's store: this node's address and a port free on it now,
    outside the kernel's ephemeral range, so no other socket is given it before the store
    listens (an ephemeral port was taken in between once: EADDRINUSE)."""
    ip = node_address()
    ports = _outside_ephemeral()
    rng = random.Random()
    port = None
    for _ in range(64 if len(ports) else 0):
        port = _bindable(ip, rng.choice(ports))
        if port is not None:
            break
    if port is None:
        port = _bindable(ip, 0)
    if port is None:
        raise OSError(f"no port can be bound on this node's address {ip}")
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"


class DeviceMesh:
    """This process's place (``node``, ``device``) in a mesh of ``n_nodes × n_devices``.

    ``bytes_sent`` counts the payload bytes this rank contributed to every exchange (as
    :class:`~hpsray.cluster.collective.CollectiveGroup` does), ``exchanges`` its sparse exchanges.
    """

    def __init__(
        self,
        address: str,
        n_nodes: int,
        n_devices: int,
        node: int,
        device: int,
        backend: str = "gloo",
        timeout_s: float | None = None,
    ) -> None:
        import torch.distributed as dist

        if not (0 <= node < n_nodes and 0 <= device < n_devices):
            raise ValueError(f"(node {node}, device {device}) outside a mesh of {n_nodes} x {n_devices}")
        self.dist, self.backend = dist, backend
        self.n_nodes, self.n_devices, self.node, self.index = n_nodes, n_devices, node, device
        self.world, self.rank = n_nodes * n_devices, node * n_devices + device
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.binding = bind_collectives(backend)
        # every wait of the mesh (its rendezvous, each operation) ends within the fault timeout
        timeout_s = faults.fault_timeout() if timeout_s is None else timeout_s
        try:
            wait = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, init_method=address, world_size=self.world, rank=self.rank, timeout=wait)
        except Exception as e:  # a process that died at its start leaves the others here
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise
            raise faults.expired(
                f"the device mesh's rendezvous at {address} (rank {self.rank} of {self.world})", timeout_s
            ) from e
        # every process forms every subgroup, in the same order (torch.distributed's rule)
        nodes = [dist.new_group([i * n_devices + d for d in range(n_devices)]) for i in range(n_nodes)]
        peers = [dist.new_group([i * n_devices + d for i in range(n_nodes)]) for d in range(n_devices)]
        self.node_group, self.peer_group = nodes[node], peers[device]
        self.bytes_sent = 0
        self.exchanges = 0

    # -- whole mesh ----------------------------------------------------------------------

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``flat`` over every rank (a new tensor; ``flat`` is untouched), in
        the order the reference states (docs/architecture.md: invariant 1): each node's devices
        in device order, then the node sums in node order (the peers of every device index sum
        the same node sums alike)."""
        if self.n_nodes == 1 or self.n_devices == 1:
            return self._sum(flat, None, self.world)
        return self._sum(self._sum(flat, self.node_group, self.n_devices), self.peer_group, self.n_nodes)

    def node_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``flat`` over this node's devices, in device order (a new tensor)."""
        return self._sum(flat, self.node_group, self.n_devices)

    def _sum(self, flat: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        """The sum over ``group`` (``size`` ranks) in its rank order: two all-reduce (``a + b``
        commutes); more all-gather and add in rank order (the backend's ring order is not fixed)."""
        out = flat.detach().to(self.device, copy=True).contiguous()
        if size <= 2:
            self.dist.all_reduce(out, group=group)
        else:
            parts = [torch.empty_like(out) for _ in range(size)]
            self.dist.all_gather(parts, out, group=group)
            out = parts[0]
            for part in parts[1:]:
                out += part
        self.bytes_sent += out.numel() * out.element_size()
        return out.to(flat.device)

    def node_broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        """Device 0's ``flat``, on every device of the node (the others' values are ignored)."""
        out = flat.detach().to(self.device, copy=True).contiguous()
        self.dist.broadcast(out, src=self.node * self.n_devices, group=self.node_group)
        return out.to(flat.device)

    def barrier(self) -> None:
        self.dist.barrier()

    def destroy(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # -- within the node: all-to-all -----------------------------------------------------

    def _alltoall(self, send: torch.Tensor, counts: list[int], width: int) -> tuple[torch.Tensor, list[int]]:
        """Rows ``send[sum(counts[:d]) : ...]`` (``width`` items each) go to device ``d``;
        returns what every device sent here, in device order, and how many rows each sent.
        Only the counts (``D`` integers) are read on the host."""
        dist, group = self.dist, self.node_group
        mine = torch.tensor(counts, dtype=torch.int64, device=self.device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=group)
        got = [int(c) for c in theirs.tolist()]
        out = torch.empty((sum(got), width), dtype=send.dtype, device=self.device)
        dist.all_to_all_single(
            out.view(-1),
            send.reshape(-1).to(self.device),
            output_split_sizes=[c * width for c in got],
            input_split_sizes=[c * width for c in counts],
            group=group,
        )
        self.bytes_sent += (sum(counts) - counts[self.index]) * width * send.element_size()
        return out, got

    def _by_device(self, keys: Any) -> tuple[Any, list[int]]:
        """``(order, rows per device)``: ``keys[order]`` grouped by the device that holds them."""
        order, offsets = group_by(device_of(keys, self.n_nodes, self.n_devices), self.n_devices)
        return order, [int(c) for c in to_host(offsets[1:] - offsets[:-1])]

    def lookup(self, keys: Any, serve: Callable[[Any], Any]) -> Any:
        """Rows of ``keys`` (this device's distinct keys of its slice; numpy, or CuPy on a GPU),
        each from the device that holds it: the keys go to their devices, each device answers
        the keys it received with ``serve(keys) -> float32[n, width]`` (its own table, in the
        keys' array module), the rows come back. Every device of the node calls this once per
        mini-batch step (with no keys when its slice is empty). On a GPU nothing but the
        per-device counts leaves the device."""
        xp = _xp(keys)
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        order, counts = self._by_device(keys)
        asked, got = self._alltoall(torch.as_tensor(keys[order].view(xp.int64)), counts, 1)
        asked_keys = xp.asarray(asked).reshape(-1).view(xp.uint64)
        rows = xp.ascontiguousarray(xp.asarray(serve(asked_keys)), dtype=xp.float32)
        back, _ = self._alltoall(torch.as_tensor(rows), got, rows.shape[1])
        out = xp.empty((keys.size, rows.shape[1]), dtype=xp.float32)
        out[order] = xp.asarray(back)
        return out

    def route(self, keys: Any, grads: Any) -> tuple[Any, Any]:
        """Send each gradient row to the device that holds its key; returns this device's
        ``(keys, grads)`` from every device of the node, in device order (duplicates kept: the
        table sums them into one optimizer step per row), in the keys' array module."""
        xp = _xp(keys)
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        grads = xp.ascontiguousarray(grads, dtype=xp.float32)
        order, counts = self._by_device(keys)
        got_keys, _ = self._alltoall(torch.as_tensor(keys[order].view(xp.int64)), counts, 1)
        got_grads, _ = self._alltoall(torch.as_tensor(grads[order]), counts, grads.shape[1])
        return xp.asarray(got_keys).reshape(-1).view(xp.uint64), xp.asarray(got_grads)

    # -- across nodes: the peers of one device index -------------------------------------

    def allgather_sparse(self, keys: Any, grads: Any) -> tuple[Any, Any]:
        """Every node's ``(keys, grads)`` for this device index, concatenated in node order, in
        the keys' array module (gathered in device memory on a GPU)."""
        self.exchanges += 1
        if self.n_nodes == 1:
            return keys, grads
        xp = _xp(keys)
        dist, group = self.dist, self.peer_group
        dim = grads.shape[1]
        n = torch.tensor([keys.size], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(n) for _ in range(self.n_nodes)]
        dist.all_gather(sizes, n, group=group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        if longest == 0:
            return keys, grads
        payload = torch.zeros((longest, 2 + dim), dtype=torch.float32, device=self.device)
        if keys.size:  # a key's 64 bits as two float32 words, then its gradient row
            words = xp.ascontiguousarray(keys, dtype=xp.uint64).view(xp.float32).reshape(-1, 2)
            payload[: keys.size, :2] = torch.as_tensor(words).to(self.device)
            payload[: keys.size, 2:] = torch.as_tensor(xp.ascontiguousarray(grads, dtype=xp.float32)).to(self.device)
        parts = [torch.empty_like(payload) for _ in range(self.n_nodes)]
        dist.all_gather(parts, payload, group=group)
        self.bytes_sent += 8 + payload.numel() * 4
        out = xp.asarray(torch.cat([p[:m] for p, m in zip(parts, lengths, strict=True)]))
        return xp.ascontiguousarray(out[:, :2]).view(xp.uint64).reshape(-1), xp.ascontiguousarray(out[:, 2:])


def _xp(a: Any) -> Any:
    """The array module of ``a``: CuPy for device arrays, numpy otherwise."""
    return array_module("cuda" if is_device_array(a) else "cpu")
