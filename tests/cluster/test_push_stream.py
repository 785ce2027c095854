"""Push propagation over TCP streams (hpsray/cluster/push_stream.py), two exchanges in one
process on loopback: what a fetch returns and waits for, and how a peer's failure reaches it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from hpsray.cluster.push_stream import Listener, StreamPushExchange
from hpsray.errors import PeerFailedError


@contextmanager
def _pair() -> Iterator[list[StreamPushExchange]]:
    """Two connected exchanges on loopback, closed at the end."""
    listeners = [Listener("127.0.0.1") for _ in range(2)]
    addresses = [lst.address for lst in listeners]
    out: list = [None, None]

    def make(rank: int) -> None:
        out[rank] = StreamPushExchange(rank, 2, listeners[rank], addresses, [None, None], timeout_s=10)

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
