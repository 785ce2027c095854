"""Push propagation over TCP streams (hpsray/cluster/push_stream.py), two exchanges in one
process on loopback: what a fetch returns and waits for, and how a peer's failure reaches it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import wire_fuzz as wire_tests  # tests/cluster/wire_fuzz.py

from hpsray.cluster import wire
from hpsray.cluster.push_stream import VERSION, Listener, StreamPushExchange, version_frame
from hpsray.errors import DataPlaneError, PeerFailedError


@contextmanager
def _pair(junk: int = 0, max_frame_bytes: int | None = None) -> Iterator[list[StreamPushExchange]]:
    """Two connected exchanges on loopback, closed at the end; ``junk`` unauthenticated
    connections hit each listener first (tests/cluster/test_wire.py)."""
    listeners = [Listener("127.0.0.1") for _ in range(2)]
    if junk:
        good = wire_tests.frame_bytes(1, b"\0" * 16, [])
        fuzzers = [
            threading.Thread(target=wire_tests.junk_connections, args=(lst.address, junk, i, good))
            for i, lst in enumerate(listeners)
        ]
        for t in fuzzers:
            t.start()
        for t in fuzzers:
            t.join()
        for lst in listeners:
            wire_tests.wait_refused(lst, junk)
    addresses = [lst.address for lst in listeners]
    out: list = [None, None]

    def make(rank: int) -> None:
        keys = [lst.key for lst in listeners]
        extra = {} if max_frame_bytes is None else {"max_frame_bytes": max_frame_bytes}
        out[rank] = StreamPushExchange(
            rank, 2, listeners[rank], addresses, [None, None], timeout_s=10, keys=keys, **extra
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        yield out
    finally:
        for x in out:
            x.close()


def _payload(clock: int) -> tuple:
    return np.array([clock], np.uint64), np.full((1, 2), clock, np.float32), np.full(3, clock, np.float32)


def test_fetch_waits_for_the_clock_and_returns_each_version_once_in_order():
    with _pair() as (a, b):
        for c in (1, 2, 3):
            b.publish("all", c, _payload(c))
        got = a.fetch("all", 3, upto=2, seen={1: 0})
        assert [(r, c) for r, c, _ in got] == [(1, 1), (1, 2)]
        assert np.array_equal(got[1][2][1], np.full((1, 2), 2, np.float32))
        assert a.fetch("all", 0, upto=None, seen={1: 2})[0][:2] == (1, 3)
        assert a.fetch("all", 0, upto=None, seen={1: 3}) == []
        assert a.received_bytes == 3 * (8 + 8 + 12)
        later = threading.Timer(0.2, lambda: b.publish("all", 4, _payload(4)))
        later.start()
        t0 = time.perf_counter()
        assert [c for _, c, _ in a.fetch("all", 4, upto=None, seen={1: 3})] == [4]
        assert time.perf_counter() - t0 >= 0.15
        a.publish("dense", 1, (None, None, np.ones(3, np.float32)))
        assert b.fetch("dense", 1, upto=1, seen={0: 0})[0][2][2].tolist() == [1.0, 1.0, 1.0]


def test_a_peer_that_failed_a_batch_ends_the_wait():
    with _pair() as (a, b):
        b.fail("batch 7")
        with pytest.raises(PeerFailedError):
            a.fetch("all", 1, upto=None, seen={1: 0})


def test_a_peer_whose_stream_ends_ends_a_wait_it_cannot_meet():
    with _pair() as (a, b):
        b.publish("all", 1, _payload(1))
        b.close()  # as when its process dies
        deadline = time.monotonic() + 5
        while a.gone is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c for _, c, _ in a.fetch("all", 1, upto=None, seen={1: 0})] == [1]  # what came is kept
        with pytest.raises(PeerFailedError):
            a.fetch("all", 2, upto=None, seen={1: 1})


def _exchange_both_ways(a: StreamPushExchange, b: StreamPushExchange) -> list:
    """Five clocks each way, fetched: what each side received, in order."""
    for c in range(1, 6):
        a.publish("all", c, _payload(c))
        b.publish("all", c, _payload(10 + c))
    got = [x.fetch("all", 5, upto=None, seen={}) for x in (a, b)]
    return [[(r, c, [None if v is None else v.tolist() for v in p]) for r, c, p in g] for g in got]


@pytest.mark.slow
def test_ten_thousand_junk_connections_per_listener_change_nothing():
    with _pair() as (a, b):
        expected = _exchange_both_ways(a, b)
    with _pair(junk=10_000) as (a, b):
        assert (a.refused, b.refused) == (10_000, 10_000)
        assert _exchange_both_ways(a, b) == expected
        with pytest.raises(OSError):  # nothing listens once the streams are formed
            wire.connect(a.inbound[0].getsockname()[:2], b"k" * 32, b"push", (1, b""), 2)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda sock: sock.sendall(b"HF\x09" + b"\0" * 13), id="unknown-kind"),
        pytest.param(lambda sock: sock.sendall(b"garbage!" * 4), id="garbage"),
        pytest.param(
            lambda sock: wire.send_frame(sock, VERSION, version_frame("all", 9), [np.ones(300, np.uint64), None, None]),
            id="oversized",
        ),
        pytest.param(
            lambda sock: wire.send_frame(sock, VERSION, version_frame("all", 9), [np.ones(2, np.float32), None, None]),
            id="keys-not-uint64",
        ),
        pytest.param(
            lambda sock: [wire.send_frame(sock, VERSION, version_frame("all", c), _payload(c)) for c in (3, 2)],
            id="out-of-order",
        ),
    ],
)
def test_a_bad_frame_from_a_peer_closes_its_stream_and_ends_the_wait_naming_why(bad):
    with _pair(max_frame_bytes=2048) as (a, b):
        bad(b.out[0])
        deadline = time.monotonic() + 5
        while a.gone is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(a.broken, DataPlaneError) and a.broken.peer == "trainer 1"
        with pytest.raises(PeerFailedError, match="trainer 1's stream ended: trainer 1: ") as info:
            a.fetch("all", 4, upto=None, seen={})
        assert isinstance(info.value.__cause__, DataPlaneError)
        b.publish("all", 1, _payload(1))  # the other direction still works
        assert [c for _, c, _ in b.fetch("all", 0, upto=None, seen={})] == []
        a.publish("all", 1, _payload(1))
        assert [c for _, c, _ in b.fetch("all", 1, upto=None, seen={})] == [1]


def test_failures_travel_as_typed_ids():
    for batch_id, shown in ((7, 7), ("batch 7", "batch 7"), (("a", 1), "('a', 1)")):
        with _pair() as (a, b):
            b.fail(batch_id)
            with pytest.raises(PeerFailedError) as info:
                a.fetch("all", 1, upto=None, seen={1: 0})
            assert info.value.batch_id == shown
