"""The aggregation mesh: every rank's TCP connections, found through one small directory actor.

Every rank listens on its node's address (the address Ray assigned to the node, or the one in
``HPSRAY_NETWORK``: :mod:`hpsray.cluster.netaddr`), tells the :class:`AggregatorDirectory` actor
its Ray node and port, and gets everyone's back once all ``world`` ranks have registered. Then,
per worker ``w`` (stripe):

- every node leader connects to every other node leader: the connection ``(owner k, client j)``
  carries leader ``j``'s node sums of the chunks node ``k`` owns, and back ``k``'s results;
- every other rank connects to its node's leader: it carries the rank's values of the stripe,
  and back the stripe's results.

Every connection is admitted by :mod:`hpsray.cluster.wire`'s HMAC challenge on the listening
rank's key (registered with its address in the directory actor, so handed out through Ray only)
and names itself in a typed hello ``(kind, worker, peer)``; a stray or unproven connection is
refused and counted, and the setup goes on. Then each direction of a connection carries, every
step, a 16-byte header ``(step, n_elements)`` and one contiguous run of ``float32`` values in a
fixed order; a header other than the step's closes the mesh with
:class:`~hpsray.errors.DataPlaneError`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from hpsray.cluster import faults, wire
from hpsray.cluster.aggregation_topology import Topology
from hpsray.errors import DataPlaneError, FaultTimeout

OWNER, LOCAL = 1, 2  # connection kinds
PURPOSE = b"aggregation"
HELLO = 1  # frame kind
_IDENT = struct.Struct("<qqq")  # kind, worker, peer (client's node for OWNER, rank for LOCAL)


class AggregatorDirectory:
    """Rendezvous of one aggregation mesh (use as an async Ray actor: :func:`start_directory`).

    ``register(rank, entry)`` returns, once all ``world`` ranks registered the same round,
    every rank's entry in rank order and the default workers per node. A rank's ``i``-th call
    joins round ``i``, so ranks building several meshes on one directory (one after the other)
    meet in the right one.
    """

    def __init__(self, world: int, workers: int, timeout_s: float = faults.DEFAULT_FAULT_TIMEOUT_S) -> None:
        if world < 1 or workers < 1:
            raise ValueError(f"world and workers must be >= 1, got {world}, {workers}")
        self.world, self.workers, self.timeout_s = world, workers, timeout_s
        self._calls = [0] * world
        self._rounds: dict[int, dict] = {}

    def __repr__(self) -> str:
        return "AggregatorDirectory"

    async def register(self, rank: int, entry: dict) -> dict:
        if not 0 <= rank < self.world:
            raise ValueError(f"{self!r}: rank {rank} outside world of {self.world}")
        i = self._calls[rank]
        self._calls[rank] += 1
        r = self._rounds.get(i)
        if r is None:
            r = self._rounds[i] = {"entries": [None] * self.world, "done": asyncio.Event(), "served": 0}
        r["entries"][rank] = entry
        if all(e is not None for e in r["entries"]):
            r["done"].set()
        try:
            await asyncio.wait_for(r["done"].wait(), self.timeout_s)
        except asyncio.TimeoutError:
            missing = [k for k, e in enumerate(r["entries"]) if e is None]
            raise FaultTimeout(f"the aggregation ranks {missing} to register with {self!r}", self.timeout_s) from None
        finally:
            r["served"] += 1
            if r["served"] == self.world:
                self._rounds.pop(i, None)
        return {"entries": list(r["entries"]), "workers": self.workers}


def start_directory(
    world: int, workers: int, node_id: str | None = None, name: str | None = None, timeout_s: float | None = None
) -> Any:
    """Start the directory actor and return its handle (no CPU reserved; on ``node_id`` when
    given); a rank waits at most ``timeout_s`` (``None``: the fault timeout) for the others to register."""
    import ray

    from hpsray.cluster.runtime import on_node

    opts: dict = {"num_cpus": 0, "max_concurrency": max(64, 4 * world)}
    if node_id is not None:
        opts["scheduling_strategy"] = on_node(node_id)
    if name:
        opts["name"] = name
    timeout = faults.fault_timeout() if timeout_s is None else timeout_s
    return ray.remote(AggregatorDirectory).options(**opts).remote(world, workers, timeout)


def local_address() -> str:
    """The address this node's aggregation listens on (``HPSRAY_NETWORK``'s, else Ray's)."""
    from hpsray.cluster import netaddr

    if os.environ.get(netaddr.NETWORK_ENV):
        return netaddr.interface_in(os.environ[netaddr.NETWORK_ENV])[1]
    return netaddr.node_address()


@dataclass
class Mesh:
    """One rank's connections: per worker, ``owner_out[k]`` (to owner node ``k``, as client),
    ``owner_in[j]`` (from client node ``j``, as owner) and ``local[r]`` (leader: to rank ``r`` of
    its node) or ``up`` (non-leader: to its leader)."""

    topology: Topology
    rank: int
    workers: int
    owner_out: list[dict[int, socket.socket]] = field(default_factory=list)
    owner_in: list[dict[int, socket.socket]] = field(default_factory=list)
    local: list[dict[int, socket.socket]] = field(default_factory=list)
    up: list[socket.socket | None] = field(default_factory=list)

    def sockets(self) -> list[socket.socket]:
        out = [s for d in self.owner_out + self.owner_in + self.local for s in d.values()]
        return out + [s for s in self.up if s is not None]

    def close(self) -> None:
        for s in self.sockets():
            try:
                s.close()
            except OSError:
                pass


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen() -> wire.AuthListener:
    """This rank's listener on its node's address (:func:`local_address`)."""
    return wire.AuthListener(local_address(), PURPOSE)


def build_mesh(
    directory: Any, rank: int, world: int, workers: int | None = None, timeout_s: float = faults.DEFAULT_FAULT_TIMEOUT_S
) -> Mesh:
    """Register with ``directory`` and open this rank's connections (every rank calls it at once).

    ``workers`` per node: ``None`` takes the directory's. Blocks until every rank registered.
    """
    import ray

    listener = listen()
    try:
        host, port = listener.address
        entry = {"node": ray.get_runtime_context().get_node_id(), "host": host, "port": port, "key": listener.key}
        try:
            reply = ray.get(directory.register.remote(rank, entry), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise faults.expired(f"the aggregation directory's reply to rank {rank}", timeout_s) from None
        return connect_mesh(listener, reply["entries"], rank, int(workers or reply["workers"]), timeout_s)
    finally:
        listener.close()


def connect_mesh(listener: wire.AuthListener, entries: list[dict], rank: int, workers: int, timeout_s: float) -> Mesh:
    """This rank's connections, given every rank's directory entry (``node``, ``host``,
    ``port``, ``key``) in rank order and this rank's ``listener`` (its entry's); Ray-free."""
    topo = Topology.from_keys([e["node"] for e in entries])
    mesh = Mesh(topo, rank, workers)
    me = topo.node_of[rank]
    leader = topo.leader(me)
    mesh.owner_out = [{} for _ in range(workers)]
    mesh.owner_in = [{} for _ in range(workers)]
    mesh.local = [{} for _ in range(workers)]
    mesh.up = [None] * workers

    def dial(to: int, kind: int, w: int, peer: int) -> socket.socket:
        e = entries[to]
        hello = (HELLO, _IDENT.pack(kind, w, peer))
        return wire.connect((e["host"], e["port"]), e["key"], PURPOSE, hello, timeout_s, peer=f"aggregation rank {to}")

    def identify(frame: wire.Frame) -> tuple[int, int, int]:
        if frame.kind != HELLO or len(frame.meta) != _IDENT.size:
            raise DataPlaneError("a peer", f"a frame of kind {frame.kind} where an aggregation hello belongs")
        kind, w, peer = _IDENT.unpack(frame.meta)
        ok = 0 <= w < workers and (
            (kind == OWNER and 0 <= peer < topo.n_nodes and peer != me)
            or (kind == LOCAL and peer != rank and 0 <= peer < topo.world and topo.node_of[peer] == me)
        )
        if rank != leader or not ok:
            raise DataPlaneError("a peer", f"hello (kind {kind}, worker {w}, peer {peer}) not owed to rank {rank}")
        return (int(kind), int(w), int(peer))

    try:
        for w in range(workers):  # the peers' listeners answer in threads of their own
            if rank == leader:
                for k in range(topo.n_nodes):
                    if k != me:
                        mesh.owner_out[w][k] = _tune(dial(topo.leader(k), OWNER, w, me))
            else:
                mesh.up[w] = _tune(dial(leader, LOCAL, w, rank))
        expected = workers * (topo.n_nodes - 1 + len(topo.members(me)) - 1) if rank == leader else 0
        for (kind, w, peer), s in listener.admit(expected, identify, timeout_s).items():
            (mesh.owner_in if kind == OWNER else mesh.local)[w][peer] = _tune(s)
        for s in mesh.sockets():
            s.setblocking(False)
    except BaseException:
        mesh.close()
        raise
    return mesh
