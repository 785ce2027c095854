"""Push propagation over direct TCP streams between the trainers (docs/architecture.md:
Consistency): each trainer sends every version it publishes to every other trainer on a
connection of its own, and a thread per incoming connection files what arrives in this
process's :class:`~hpsray.cluster.updates.Versions` book, so ``fetch`` waits on a local
condition: no Ray object, no actor call per mini-batch (each cost a round trip through the
mailbox actor and the object store, on the trainer's core).

The trainers' mailboxes stay: they publish each trainer's stream address (the rendezvous in
``join``) and stand for its liveness while a ``fetch`` waits, as under the mailbox push.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from collections.abc import Hashable
from typing import Any

import ray

from hpsray.cluster.faults import fault_timeout
from hpsray.cluster.netaddr import node_address
from hpsray.cluster.propagation import Exchange
from hpsray.cluster.updates import Payload, Versions, payload_bytes
from hpsray.errors import PeerFailedError

_HEADER = struct.Struct("<Qc")  # body length, kind: b"D" a version, b"F" a failure, b"H" hello (rank)


class Listener:
    """This trainer's end of the streams: a socket listening on ``ip`` (the node's address)."""

    def __init__(self, ip: str | None = None) -> None:
        ip = ip or node_address()
        self.sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        self.sock.bind((ip, 0))
        self.sock.listen(64)
        self.address: tuple[str, int] = (ip, self.sock.getsockname()[1])


def _send(sock: socket.socket, kind: bytes, body: bytes) -> None:
    sock.sendall(_HEADER.pack(len(body), kind) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


class StreamPushExchange(Exchange):
    """A trainer's push propagation over TCP (see the module docstring); the
    :class:`~hpsray.cluster.consistency.Exchange` contract.

    Args:
        rank, world: this trainer and how many there are.
        listener: this trainer's :class:`Listener` (its address already in its mailbox).
        addresses: every trainer's listener address, in rank order.
        mailboxes: every trainer's mailbox, in rank order (probed while a fetch waits).
        timeout_s: how long to wait for the other trainers' connections.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        listener: Listener,
        addresses: list[tuple[str, int]],
        mailboxes: list[Any],
        timeout_s: float = 120.0,
    ) -> None:
        super().__init__(rank, world)
        self.mailboxes = mailboxes
        self.versions = Versions(world)
        self._changed = threading.Condition()
        self.failed: Hashable | None = None  # batch id another trainer failed
        self.gone: int | None = None  # a trainer whose stream ended
        self._closing = False
        self.out: dict[int, socket.socket] = {}
        for q, address in enumerate(addresses):
            if q != rank:
                sock = socket.create_connection(address, timeout=timeout_s)
                sock.settimeout(fault_timeout())  # a send to a peer that stopped reading ends
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _send(sock, b"H", struct.pack("<q", rank))
                self.out[q] = sock
        self.inbound: list[socket.socket] = []
        listener.sock.settimeout(timeout_s)
        try:
            for _ in range(world - 1):
                conn, _ = listener.sock.accept()
                conn.settimeout(None)
                self.inbound.append(conn)
                threading.Thread(target=self._read, args=(conn,), daemon=True, name="push-stream").start()
        finally:
            listener.sock.close()

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        """Send the version to every other trainer; a stream that cannot take it within the
        fault timeout (a cut link, a peer that stopped reading) raises :class:`PeerFailedError`."""
        body = pickle.dumps((channel, clock, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for q, sock in self.out.items():
            try:
                _send(sock, b"D", body)
            except OSError as e:
                raise PeerFailedError(f"(clock {clock}: the stream to trainer {q} failed: {e})") from e

    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]:
        """The other trainers' versions not fetched yet, up to ``upto``, once each has sent
        ``oldest`` or newer, ``(rank, clock, payload)`` oldest first (``seen``: unused, as under
        the mailbox push)."""
        v = self.versions
        others = [r for r in range(self.world) if r != self.rank]
        t0 = time.perf_counter()
        with self._changed:
            while True:
                ready = all(v.newest(channel, r) >= oldest for r in others)
                if self.failed is not None:
                    raise PeerFailedError(self.failed)
                if ready:
                    break
                if self.gone is not None:
                    raise PeerFailedError(f"(clock {oldest}: trainer {self.gone}'s stream ended)")
                if not self._changed.wait(timeout=2.0):
                    self._probe(oldest)
            got = [u for r in others for u in v.take(channel, self.rank, r, upto)]
            v.forget(lambda r: [self.rank])
        self.wait_s += time.perf_counter() - t0
        got.sort(key=lambda u: (u[1], u[0]))
        out = [(r, c, upd[0]) for r, c, upd in got]
        self.received_bytes += sum(payload_bytes(p) for _, _, p in out)
        return out

    def _probe(self, clock: int, every_s: float = 2.0) -> None:
        """While a fetch waits: a mailbox dies with its trainer, and a dead trainer's versions
        never come (:class:`PeerFailedError`, so the driver restarts the group)."""
        self._changed.release()
        try:
            others = [box for q, box in enumerate(self.mailboxes) if q != self.rank]
            for probe in [box.__ray_ready__.remote() for box in others]:
                try:
                    ray.get(probe, timeout=every_s)
                except ray.exceptions.GetTimeoutError:
                    continue  # busy, not dead
                except ray.exceptions.RayActorError:
                    raise PeerFailedError(f"(clock {clock}: another trainer's mailbox is gone)") from None
        finally:
            self._changed.acquire()

    def fail(self, batch_id: Hashable) -> None:
        """Tell every other trainer that this one failed ``batch_id`` (their waits raise
        :class:`PeerFailedError`); returns once it is on its way to each."""
        body = pickle.dumps(batch_id)
        for sock in self.out.values():
            try:
                _send(sock, b"F", body)
            except OSError:
                continue  # that trainer is gone already

    def close(self) -> None:
        """End the streams (a re-formed group makes new ones)."""
        self._closing = True
        for sock in [*self.out.values(), *self.inbound]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _read(self, sock: socket.socket) -> None:
        """One incoming stream: file each version in the book, until the stream ends."""
        peer = -1
        try:
            while True:
                head = _recv_exact(sock, _HEADER.size)
                if head is None:
                    break
                n, kind = _HEADER.unpack(head)
                body = _recv_exact(sock, n)
                if body is None:
                    break
                if kind == b"H":
                    peer = struct.unpack("<q", body)[0]
                    continue
                if kind == b"F":
                    with self._changed:
                        self.failed = pickle.loads(body)
                        self._changed.notify_all()
                    continue
                channel, clock, payload = pickle.loads(body)
                with self._changed:
                    self.versions.put(channel, peer, clock, [payload])
                    self._changed.notify_all()
        except OSError:
            pass
        if not self._closing:
            with self._changed:
                self.gone = peer
                self._changed.notify_all()
