"""Push propagation over direct TCP streams between the trainers (docs/architecture.md:
Consistency): each trainer sends every version it publishes to every other trainer on a
connection of its own, and a thread per incoming connection files what arrives in this
process's :class:`~hpsray.cluster.updates.Versions` book, so ``fetch`` waits on a local
condition: no Ray object, no actor call per mini-batch (each cost a round trip through the
mailbox actor and the object store, on the trainer's core).

The trainers' mailboxes stay: they publish each trainer's stream address and listener key (the
rendezvous in ``join``, through Ray) and stand for its liveness while a ``fetch`` waits. Every
stream is admitted by :mod:`hpsray.cluster.wire`'s HMAC challenge on that key and carries typed
frames (a hello, then versions and failures: never a pickle); the listener closes once the
``world - 1`` peers are in.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import ray

from hpsray.cluster import wire
from hpsray.cluster.faults import fault_timeout
from hpsray.cluster.netaddr import node_address
from hpsray.cluster.propagation import Exchange
from hpsray.cluster.updates import Payload, Versions, payload_bytes
from hpsray.errors import DataPlaneError, PeerFailedError

PURPOSE = b"push"
HELLO, VERSION, FAIL = 1, 2, 3  # frame kinds
_HELLO = struct.Struct("<qq")  # rank, world
_CLOCK = struct.Struct("<q")
_INT = struct.Struct("<q")


class Listener(wire.AuthListener):
    """This trainer's end of the streams: an :class:`~hpsray.cluster.wire.AuthListener` on ``ip``
    (the node's address); its ``address`` and ``key`` go to the other trainers through its mailbox."""

    def __init__(self, ip: str | None = None) -> None:
        super().__init__(ip or node_address(), PURPOSE)


def version_frame(channel: str, clock: int) -> bytes:
    """The meta of a version frame: the channel's name (length-prefixed UTF-8) and the clock."""
    name = channel.encode()
    return bytes([len(name)]) + name + _CLOCK.pack(clock)


def parse_version(frame: wire.Frame, peer: str) -> tuple[str, int, Payload]:
    """``(channel, clock, payload)`` of a version frame; :class:`DataPlaneError` if it is not one."""
    meta = frame.meta
    if not meta or len(meta) != 1 + meta[0] + _CLOCK.size or len(frame.arrays) != 3:
        raise DataPlaneError(peer, "malformed version frame")
    try:
        channel = meta[1 : 1 + meta[0]].decode()
    except UnicodeDecodeError:
        raise DataPlaneError(peer, "malformed version frame: channel name") from None
    (clock,) = _CLOCK.unpack_from(meta, 1 + meta[0])
    keys, grads, dense = frame.arrays
    if keys is not None and (keys.dtype != np.uint64 or keys.ndim != 1):
        raise DataPlaneError(peer, f"malformed version frame: keys {keys.dtype} {keys.shape}")
    if (keys is None) != (grads is None) or (
        grads is not None and (grads.dtype != np.float32 or grads.ndim != 2 or grads.shape[0] != keys.shape[0])  # type: ignore[union-attr]
    ):
        raise DataPlaneError(peer, "malformed version frame: gradients do not match the keys")
    if dense is not None and (dense.dtype != np.float32 or dense.ndim != 1):
        raise DataPlaneError(peer, f"malformed version frame: dense {dense.dtype} {dense.shape}")
    return channel, clock, (keys, grads, dense)


def fail_frame(batch_id: Hashable) -> bytes:
    """A failure frame's meta: an integer batch id, or any other id as its text."""
    if isinstance(batch_id, int | np.integer) and -(2**63) <= int(batch_id) < 2**63:
        return b"i" + _INT.pack(int(batch_id))
    return b"s" + str(batch_id).encode()[: wire.MAX_META - 1]


def parse_fail(meta: bytes, peer: str) -> Hashable:
    if meta[:1] == b"i" and len(meta) == 1 + _INT.size:
        return int(_INT.unpack_from(meta, 1)[0])
    if meta[:1] == b"s":
        return meta[1:].decode(errors="replace")
    raise DataPlaneError(peer, "malformed failure frame")


class StreamPushExchange(Exchange):
    """A trainer's push propagation over TCP (see the module docstring); the
    :class:`~hpsray.cluster.consistency.Exchange` contract.

    Args:
        rank, world: this trainer and how many there are.
        listener: this trainer's :class:`Listener` (its address and key already in its mailbox).
        addresses: every trainer's listener address, in rank order.
        mailboxes: every trainer's mailbox, in rank order (probed while a fetch waits).
        timeout_s: how long to wait for the other trainers' connections.
        keys: every trainer's listener key, in rank order (from its mailbox).
        max_frame_bytes: the largest version a peer may send; a larger one ends its stream.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        listener: Listener,
        addresses: list[tuple[str, int]],
        mailboxes: list[Any],
        timeout_s: float = 120.0,
        keys: list[bytes] | None = None,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME,
    ) -> None:
        super().__init__(rank, world)
        if keys is None or len(keys) != world:
            raise ValueError("every trainer's listener key is needed (its mailbox hands it out)")
        self.mailboxes = mailboxes
        self.versions = Versions(world)
        self.max_frame_bytes = max_frame_bytes
        self._changed = threading.Condition()
        self.failed: Hashable | None = None  # batch id another trainer failed
        self.gone: int | None = None  # a trainer whose stream ended
        self.broken: DataPlaneError | None = None  # why a stream was closed (a bad frame)
        self.refused = 0  # connections the listener refused while the streams formed
        self._closing = False
        self.out: dict[int, socket.socket] = {}
        self.inbound: list[socket.socket] = []
        try:
            for q, address in enumerate(addresses):
                if q != rank:
                    sock = wire.connect(
                        tuple(address),  # type: ignore[arg-type]
                        keys[q],
                        PURPOSE,
                        (HELLO, _HELLO.pack(rank, world)),
                        timeout_s,
                        peer=f"trainer {q} ({address[0]}:{address[1]})",
                    )
                    sock.settimeout(fault_timeout())  # a send to a peer that stopped reading ends
                    self.out[q] = sock
            admitted = listener.admit(world - 1, self._identify, timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
            self.refused = listener.refused
        for q, conn in sorted(admitted.items()):
            self.inbound.append(conn)
            threading.Thread(target=self._read, args=(conn, q), daemon=True, name="push-stream").start()

    def _identify(self, hello: wire.Frame) -> int:
        """The rank a hello frame names: another trainer of this world."""
        if hello.kind != HELLO or len(hello.meta) != _HELLO.size:
            raise DataPlaneError("a peer", f"a frame of kind {hello.kind} where a hello belongs")
        rank, world = _HELLO.unpack(hello.meta)
        if world != self.world or not 0 <= rank < world or rank == self.rank:
            here = f"this is trainer {self.rank} of {self.world}"
            raise DataPlaneError("a peer", f"hello as trainer {rank} of {world}; {here}")
        return int(rank)

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        """Send the version to every other trainer; a stream that cannot take it within the
        fault timeout (a cut link, a peer that stopped reading) raises :class:`PeerFailedError`."""
        meta = version_frame(channel, clock)
        for q, sock in self.out.items():
            try:
                wire.send_frame(sock, VERSION, meta, payload)
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
                    why = f": {self.broken}" if self.broken is not None else ""
                    raise PeerFailedError(f"(clock {oldest}: trainer {self.gone}'s stream ended{why})") from self.broken
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
        meta = fail_frame(batch_id)
        for sock in self.out.values():
            try:
                wire.send_frame(sock, FAIL, meta)
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

    def _read(self, sock: socket.socket, peer: int) -> None:
        """One incoming stream: file each version in the book, until the stream ends. A frame
        that is malformed, oversized or older than one already filed closes the stream (its
        fetches then raise :class:`PeerFailedError` naming why)."""
        name = f"trainer {peer}"
        newest: dict[str, int] = {}
        try:
            while True:
                frame = wire.read_frame(sock, name, self.max_frame_bytes, kinds=(VERSION, FAIL))
                if frame is None:
                    break
                if frame.kind == FAIL:
                    failed = parse_fail(frame.meta, name)
                    with self._changed:
                        self.failed = failed
                        self._changed.notify_all()
                    continue
                channel, clock, payload = parse_version(frame, name)
                if clock <= newest.get(channel, 0):
                    raise DataPlaneError(name, f"version {clock} of {channel!r} after version {newest[channel]}")
                newest[channel] = clock
                with self._changed:
                    self.versions.put(channel, peer, clock, [payload])
                    self._changed.notify_all()
        except DataPlaneError as e:
            if not self._closing:
                wire.log.warning("push stream: %s", e)
                self.broken = e
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except OSError:
            pass
        if not self._closing:
            with self._changed:
                self.gone = peer
                self._changed.notify_all()
