"""The chunked aggregation mesh's admission (hpsray/cluster/aggregation_mesh.py: connect_mesh;
issue 45): ranks as threads on loopback, their listeners hit by connections without the key or
with a wrong hello; the setup goes on and the sums equal the documented ones."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from wire_fuzz import frame_bytes, junk_connections, wait_refused  # tests/cluster/wire_fuzz.py

from hpsray.cluster import wire
from hpsray.cluster.aggregation import hierarchical_sum
from hpsray.cluster.aggregation_mesh import _IDENT, HELLO, LOCAL, OWNER, PURPOSE, connect_mesh
from hpsray.cluster.aggregation_stream import StreamEngine
from hpsray.errors import AuthenticationError

NODE_OF = (0, 1, 0)  # rank 2 streams through node 0's leader: both kinds of connection
WORKERS = 2


def _listeners() -> tuple[list[wire.AuthListener], list[dict]]:
    listeners = [wire.AuthListener("127.0.0.1", PURPOSE) for _ in NODE_OF]
    entries = [
        {"node": f"node-{n}", "host": lst.address[0], "port": lst.address[1], "key": lst.key}
        for n, lst in zip(NODE_OF, listeners, strict=True)
    ]
    return listeners, entries


def _meshes(listeners, entries):
    meshes: list = [None] * len(NODE_OF)
    errors: list = []

    def build(r: int) -> None:
        try:
            meshes[r] = connect_mesh(listeners[r], entries, r, WORKERS, timeout_s=20)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            listeners[r].close()

    threads = [threading.Thread(target=build, args=(r,)) for r in range(len(NODE_OF))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return meshes


def _sums(meshes) -> list:
    engines = [StreamEngine(m, 4096, timeout_s=20) for m in meshes]
    parts = [np.random.default_rng(r).standard_normal(9000).astype(np.float32) for r in range(len(NODE_OF))]
    outs: list = [None] * len(engines)

    def go(r: int) -> None:
        outs[r] = engines[r].run(0, parts[r])

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e in engines:
        e.close()
    expected = hierarchical_sum(parts, NODE_OF)
    assert all(np.array_equal(o, expected) for o in outs)
    return outs


def test_stray_and_wrong_hellos_are_refused_and_the_setup_goes_on():
    listeners, entries = _listeners()
    leader = listeners[0]
    stray = wire.connect(leader.address, leader.key, PURPOSE, (HELLO, b"hpsragrg"), 5)  # the old magic
    wrong_slot = wire.connect(leader.address, leader.key, PURPOSE, (HELLO, _IDENT.pack(OWNER, 0, 0)), 5)  # itself
    with pytest.raises(AuthenticationError):
        wire.connect(leader.address, wire.new_key(), PURPOSE, (HELLO, _IDENT.pack(LOCAL, 0, 2)), 5)
    wait_refused(leader, 1)  # the unproven one, at once; the hellos when the setup reads them
    meshes = _meshes(listeners, entries)
    assert leader.refused == 3
    _sums(meshes)
    stray.close()
    wrong_slot.close()


@pytest.mark.slow
def test_ten_thousand_junk_connections_per_listener_change_no_sum():
    listeners, entries = _listeners()
    good = frame_bytes(HELLO, _IDENT.pack(LOCAL, 0, 2), [])
    fuzzers = [
        threading.Thread(target=junk_connections, args=(lst.address, 10_000, i, good))
        for i, lst in enumerate(listeners)
    ]
    for t in fuzzers:
        t.start()
    for t in fuzzers:
        t.join()
    for lst in listeners:
        wait_refused(lst, 10_000)
    _sums(_meshes(listeners, entries))
