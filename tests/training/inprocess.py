"""Several trainers in one process, one thread each: a collective group, a relaxed-mode exchange
and a device mesh with what the strategies need of the real ones (``cluster/collective.py``,
``cluster/push_stream.py``, ``cluster/mesh.py``), gathered and summed in rank order. They need
no Ray and no network, so the same strategies run here on a GPU machine without Ray."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from hpsray.cluster.updates import Payload, Versions, payload_bytes
from hpsray.errors import PeerFailedError
from hpsray.kernels.arrays import array_module, is_device_array
from hpsray.tiers.partition import Routing, device_of


def _xp(a: Any) -> Any:
    return array_module("cuda" if is_device_array(a) else "cpu")


class _Meeting:
    """``n`` threads put a value each and all get every value, in rank order."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=120), [None] * n

    def gather(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class ThreadGroup(_Meeting):
    """A collective group of ``n`` ranks (``member(rank)`` is rank's side)."""

    def member(self, rank: int) -> ThreadMember:
        return ThreadMember(self, rank)


class ThreadMember:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.bytes_sent, self.uncounted = group, rank, 0, 0

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]:
        """As the collective group's; ``counts``, when given, must be every rank's key count (a
        real group would cut the payloads at them): checked here. ``uncounted`` counts the
        calls without them (each an exchange of sizes and a read-back in a real group)."""
        xp = _xp(keys)
        got = self.group.gather(self.rank, (keys, grads))
        if counts is None:
            self.uncounted += 1
        else:
            assert [int(c) for c in counts] == [len(k) for k, _ in got], (list(counts), [len(k) for k, _ in got])
        self.bytes_sent += int(keys.nbytes + grads.nbytes)
        return xp.concatenate([k for k, _ in got]), xp.concatenate([g for _, g in got])

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        got = self.group.gather(self.rank, flat.detach().clone())
        total = got[0].clone()
        for part in got[1:]:
            total += part
        self.bytes_sent += flat.numel() * 4
        return total


class ThreadExchange:
    """A relaxed mode's update propagation among threads (``rank``'s side of ``board``)."""

    def __init__(self, board: ExchangeBoard, rank: int) -> None:
        self.board, self.rank, self.world = board, rank, board.world
        self.received_bytes = 0
        self.wait_s = 0.0

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        with self.board.changed:
            self.board.versions.put(channel, self.rank, clock, payload)
            self.board.changed.notify_all()

    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]:
        b, others = self.board, [r for r in range(self.world) if r != self.rank]
        with b.changed:
            ok = b.changed.wait_for(
                lambda: b.failed is not None or all(b.versions.newest(channel, r) >= oldest for r in others), 120
            )
            if b.failed is not None:
                raise PeerFailedError(b.failed)
            assert ok, "a peer never published"
            out = [u for r in others for u in b.versions.take(channel, self.rank, r, upto)]
        self.received_bytes += sum(payload_bytes(p) for _, _, p in out)
        return sorted(out, key=lambda u: (u[1], u[0]))

    def fail(self, batch_id: Hashable) -> None:
        with self.board.changed:
            self.board.failed = batch_id
            self.board.changed.notify_all()

    def close(self) -> None:
        pass


class ExchangeBoard:
    def __init__(self, world: int) -> None:
        self.world, self.versions, self.changed = world, Versions(world), threading.Condition()
        self.failed: Hashable | None = None

    def member(self, rank: int) -> ThreadExchange:
        return ThreadExchange(self, rank)


class ThreadMesh(_Meeting):
    """The devices of one node (``n`` of them) as threads; ``member(d)`` is device ``d``'s mesh."""

    def member(self, device: int) -> ThreadMeshMember:
        return ThreadMeshMember(self, device)


class ThreadMeshMember:
    def __init__(self, mesh: ThreadMesh, index: int) -> None:
        self.mesh, self.index, self.bytes_sent, self.unrouted = mesh, index, 0, 0

    def _send(self, keys: Any, *rows: Any) -> list[tuple[Any, ...]]:
        """Each device's part of ``keys`` (and ``rows``), those it holds; what every device sent here."""
        where = device_of(keys, 1, self.mesh.n)
        parts = [tuple(a[where == d] for a in (keys, *rows)) for d in range(self.mesh.n)]
        got = self.mesh.gather(self.index, parts)
        return [got[d][self.index] for d in range(self.mesh.n)]

    def _check(self, keys: Any, routing: Routing | None, asked: list[tuple[Any, ...]]) -> None:
        """A routing given must say what the real mesh would find: where each key goes and how
        many keys come from each device (it reads nothing back when given one)."""
        if routing is None:
            self.unrouted += 1
            return
        where = device_of(keys, 1, self.mesh.n)
        assert routing.counts == [int((where == d).sum()) for d in range(self.mesh.n)], routing
        assert routing.got == [len(a[0]) for a in asked], (routing.got, [len(a[0]) for a in asked])
        assert (where[routing.order][1:] >= where[routing.order][:-1]).all()

    def lookup(self, keys: Any, serve: Callable[[Any], Any], routing: Routing | None = None) -> Any:
        xp = _xp(keys)
        asked = self._send(keys)
        self._check(keys, routing, asked)
        answers = [serve(k) for (k,) in asked]
        back = self.mesh.gather(self.index, answers)  # back[d][e]: device d's rows for device e's keys
        where = device_of(keys, 1, self.mesh.n)
        out = xp.empty((keys.size, back[0][0].shape[1]), dtype=xp.float32)
        for d in range(self.mesh.n):
            out[where == d] = back[d][self.index]
        return out

    def route(self, keys: Any, grads: Any, routing: Routing | None = None) -> tuple[Any, Any]:
        xp = _xp(keys)
        got = self._send(keys, grads)
        self._check(keys, routing, got)
        return xp.concatenate([k for k, _ in got]), xp.concatenate([g for _, g in got])

    def allgather_sparse(self, keys: Any, grads: Any, counts: Sequence[int] | None = None) -> tuple[Any, Any]:
        assert counts is None or [int(c) for c in counts] == [len(keys)], (counts, len(keys))
        return keys, grads  # one node

    def allreduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        got = self.mesh.gather(self.index, flat.detach().clone())
        total = got[0].clone()
        for part in got[1:]:
            total += part
        return total


def run_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank, each in its own thread (rank 0 in this one); their results."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(1, n)]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
