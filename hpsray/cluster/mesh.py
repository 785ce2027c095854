"""The device mesh: every device process of every node, ``D`` per node (docs/architecture.md:
Devices).

Three kinds of ``torch.distributed`` group (``gloo`` on CPU, ``nccl`` on GPU), formed at once by
every process: **world** (rank ``node * D + device``: the dense sum, the "inputs ok" flag),
**node** (its ``D`` processes: :meth:`DeviceMesh.lookup` and :meth:`DeviceMesh.route`, all-to-all)
and **peers** (one device index on every node, ``N > 1``: :meth:`DeviceMesh.allgather_sparse`).
Received parts are concatenated in rank order (bit-equal copies). The rendezvous and every
operation end within ``timeout_s`` in :class:`~hpsray.errors.FaultTimeout`. A process is in at
most one mesh, and uses either it or :class:`~hpsray.cluster.collective.CollectiveGroup`.

The rendezvous: rank 0 runs torch's ``TCPStore`` on a socket it bound to the node's address
(torch's own binds every address), and the address carries a job token (made by
:func:`rendezvous_address`, handed out through Ray): before the group forms, every rank checks
the store's HMAC of the token and rank 0 checks every rank's, so a foreign or stale store, or a
rank without the token, fails with :class:`~hpsray.errors.AuthenticationError`. What remains open
is torch's: the store and gloo/NCCL's own connections take any client (docs/operations.md:
Listening sockets).
"""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

from hpsray.cluster import faults
from hpsray.cluster.netaddr import bind_collectives, node_address
from hpsray.errors import AuthenticationError
from hpsray.kernels.arrays import array_module, is_device_array, to_host
from hpsray.tiers.partition import Routing, device_of, group_by

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


def rendezvous_address(ip: str | None = None) -> str:
    """``tcp://ip:port?token=HEX`` for rank 0's store: this node's address (or ``ip``), a port
    free on it now, outside the kernel's ephemeral range, so no other socket is given it before
    the store listens (an ephemeral port was taken in between once: EADDRINUSE), and a fresh
    job token (pass the address only through Ray)."""
    ip = ip or node_address()
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
    return f"tcp://{host}:{port}?token={secrets.token_hex(32)}"


def _proof(token: bytes, what: str) -> bytes:
    return hmac.new(token, what.encode(), hashlib.sha256).digest()


def open_store(address: str, world: int, rank: int, timeout_s: float) -> Any:
    """The rendezvous store at ``address`` (:func:`rendezvous_address`'s), checked: rank 0
    serves it on a socket bound to the address's host only (the store owns and closes it);
    every rank proves the token and rank 0 checks every proof before returning
    (:class:`AuthenticationError` otherwise)."""
    import torch.distributed as dist

    parts = urlsplit(address)
    token_hex = parse_qs(parts.query).get("token", [""])[0]
    if parts.scheme != "tcp" or not parts.hostname or not parts.port or len(token_hex) != 64:
        raise ValueError(f"a device mesh address is tcp://host:port?token=<64 hex digits>, got {address.split('?')[0]}")
    token, host, port = bytes.fromhex(token_hex), parts.hostname, parts.port
    wait = timedelta(seconds=timeout_s)
    if rank == 0:
        listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(128)
        store = dist.TCPStore(
            host, port, world, True, timeout=wait, wait_for_workers=False, master_listen_fd=listening.detach()
        )
        store.set("hpsray/proof/store", _proof(token, "store").hex())
    else:
        store = dist.TCPStore(host, port, world, False, timeout=wait)
    if not hmac.compare_digest(bytes(store.get("hpsray/proof/store")), _proof(token, "store").hex().encode()):
        raise AuthenticationError(f"the device mesh's store at {host}:{port}", "it does not hold this job's token")
    store.set(f"hpsray/proof/rank/{rank}", _proof(token, f"rank {rank}").hex())
    if rank == 0:
        for r in range(world):
            got = bytes(store.get(f"hpsray/proof/rank/{r}"))
            if not hmac.compare_digest(got, _proof(token, f"rank {r}").hex().encode()):
                raise AuthenticationError(f"the device mesh's rank {r}", "it did not prove this job's token")
        store.set("hpsray/proof/checked", "1")
    else:
        store.get("hpsray/proof/checked")
    return store


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
            store = open_store(address, self.world, self.rank, timeout_s)
            dist.init_process_group(backend, store=store, world_size=self.world, rank=self.rank, timeout=wait)
        except Exception as e:  # a process that died at its start leaves the others here
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise
            raise faults.expired(
                f"the device mesh's rendezvous at {address.split('?')[0]} (rank {self.rank} of {self.world})", timeout_s
            ) from e
        # every process forms every subgroup, in the same order (torch.distributed's rule)
        nodes = [dist.new_group([i * n_devices + d for d in range(n_devices)]) for i in range(n_nodes)]
        peers = [dist.new_group([i * n_devices + d for i in range(n_nodes)]) for d in range(n_devices)]
        self.node_group, self.peer_group = nodes[node], peers[device]
        self.bytes_sent = 0
        self.exchanges = 0
        self.count_exchanges = 0  # all-to-alls of counts (none where the caller routes)

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

    def _alltoall(
        self, send: torch.Tensor, counts: list[int], width: int, got: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows ``send[sum(counts[:d]) : ...]`` (``width`` items each) go to device ``d``;
        returns what every device sent here, in device order, and how many rows each sent
        (``got``, when the caller knows it; else the counts, ``D`` integers, are exchanged and
        read on the host: ``count_exchanges`` counts those)."""
        dist, group = self.dist, self.node_group
        if got is None:
            mine = torch.tensor(counts, dtype=torch.int64, device=self.device)
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=group)
            got = [int(c) for c in theirs.tolist()]
            self.count_exchanges += 1
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

    def _routed(self, keys: Any, routing: Routing | None) -> tuple[Any, list[int], list[int] | None]:
        if routing is None:
            order, counts = self._by_device(keys)
            return order, counts, None
        if len(routing.counts) != self.n_devices or sum(routing.counts) != keys.size:
            raise ValueError(f"device mesh: a routing of {routing.counts} for {keys.size} keys")
        return routing.order, list(routing.counts), list(routing.got)

    def lookup(self, keys: Any, serve: Callable[[Any], Any], routing: Routing | None = None) -> Any:
        """Rows of ``keys`` (this device's distinct keys of its slice; numpy, or CuPy on a GPU),
        each from the device that holds it: the keys go to their devices, each device answers
        the keys it received with ``serve(keys) -> float32[n, width]`` (its own table, in the
        keys' array module), the rows come back. Every device of the node calls this once per
        mini-batch step (with no keys when its slice is empty). ``routing``: where the keys go
        and how many come from each device, when the caller knows (then nothing is read back;
        else the counts are exchanged and read once)."""
        xp = _xp(keys)
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        order, counts, known = self._routed(keys, routing)
        asked, got = self._alltoall(torch.as_tensor(keys[order].view(xp.int64)), counts, 1, known)
        asked_keys = xp.asarray(asked).reshape(-1).view(xp.uint64)
        rows = xp.ascontiguousarray(xp.asarray(serve(asked_keys)), dtype=xp.float32)
        back, _ = self._alltoall(torch.as_tensor(rows), got, rows.shape[1], counts)  # what was asked comes back
        out = xp.empty((keys.size, rows.shape[1]), dtype=xp.float32)
        out[order] = xp.asarray(back)
        return out

    def route(self, keys: Any, grads: Any, routing: Routing | None = None) -> tuple[Any, Any]:
        """Send each gradient row to the device that holds its key; returns this device's
        ``(keys, grads)`` from every device of the node, in device order (duplicates kept: the
        table sums them into one optimizer step per row), in the keys' array module;
        ``routing`` as :meth:`lookup`'s."""
        xp = _xp(keys)
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        grads = xp.ascontiguousarray(grads, dtype=xp.float32)
        order, counts, known = self._routed(keys, routing)
        got_keys, got = self._alltoall(torch.as_tensor(keys[order].view(xp.int64)), counts, 1, known)
        got_grads, _ = self._alltoall(torch.as_tensor(grads[order]), counts, grads.shape[1], got)
        return xp.asarray(got_keys).reshape(-1).view(xp.uint64), xp.asarray(got_grads)

    # -- across nodes: the peers of one device index -------------------------------------

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]:
        """Every node's ``(keys, grads)`` for this device index, concatenated in node order, in
        the keys' array module (gathered in device memory on a GPU). ``counts``: every node's
        number of keys, when the caller knows them (then no sizes are exchanged or read back;
        ``ValueError`` when this node's is not ``keys``'s)."""
        self.exchanges += 1
        if self.n_nodes == 1:
            return keys, grads
        xp = _xp(keys)
        dist, group = self.dist, self.peer_group
        dim = grads.shape[1]
        if counts is None:
            n = torch.tensor([keys.size], dtype=torch.int64, device=self.device)
            sizes = [torch.empty_like(n) for _ in range(self.n_nodes)]
            dist.all_gather(sizes, n, group=group)
            lengths = [int(s.item()) for s in sizes]
            self.bytes_sent += 8
        elif len(counts) != self.n_nodes or int(counts[self.node]) != keys.size:
            raise ValueError(f"device mesh node {self.node}: counts {list(counts)} do not give its {keys.size} keys")
        else:
            lengths = [int(c) for c in counts]
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
        self.bytes_sent += payload.numel() * 4
        out = xp.asarray(torch.cat([p[:m] for p, m in zip(parts, lengths, strict=True)]))
        return xp.ascontiguousarray(out[:, :2]).view(xp.uint64).reshape(-1), xp.ascontiguousarray(out[:, 2:])


def _xp(a: Any) -> Any:
    """The array module of ``a``: CuPy for device arrays, numpy otherwise."""
    return array_module("cuda" if is_device_array(a) else "cpu")
