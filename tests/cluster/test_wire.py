"""The authenticated, typed data plane (hpsray/cluster/wire.py; issue 45), on loopback in this
process: who a listener admits, what the frame reader accepts, and that no hpsray code unpickles."""

from __future__ import annotations

import ast
import pathlib
import random
import socket
import struct

import numpy as np
import pytest
from wire_fuzz import frame_bytes, junk_connections, wait_refused  # tests/cluster/wire_fuzz.py

from hpsray.cluster import wire
from hpsray.errors import AuthenticationError, DataPlaneError, FaultTimeout

HELLO = 1


def _ident(frame: wire.Frame) -> int:
    if frame.kind != HELLO or len(frame.meta) != 8:
        raise DataPlaneError("a peer", "not a hello")
    return struct.unpack("<q", frame.meta)[0]


def _hello(who: int) -> tuple[int, bytes]:
    return HELLO, struct.pack("<q", who)


def test_a_connection_without_the_secret_is_refused_before_a_frame_is_read(monkeypatch):
    reads = []
    real_read = wire.read_frame
    monkeypatch.setattr(wire, "read_frame", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    listener = wire.AuthListener("127.0.0.1", b"test")
    try:
        # 1. a client with another key: refused at the challenge, and told so
        with pytest.raises(AuthenticationError):
            wire.connect(listener.address, wire.new_key(), b"test", _hello(1), 5)
        # 2. a raw client that skips the challenge and sends a well-formed hello frame
        raw = socket.create_connection(listener.address)
        wire.send_frame(raw, *_hello(2))
        raw.shutdown(socket.SHUT_WR)
        assert raw.recv(100)[: len(wire.CHALLENGE)] == wire.CHALLENGE  # then the listener hangs up
        assert raw.recv(100) == b""
        raw.close()
        # 3. the right key but another purpose (a key is bound to what it admits to)
        with pytest.raises(AuthenticationError):
            wire.connect(listener.address, listener.key, b"other", _hello(3), 5)
        assert reads == []  # no frame of theirs was read
        # a real peer is still admitted, and only it
        real = wire.connect(listener.address, listener.key, b"test", _hello(7), 5)
        admitted = listener.admit(1, _ident, timeout_s=5)
        assert list(admitted) == [7] and len(reads) == 1
        assert listener.refused == 3
        real.sendall(b"ping")
        assert admitted[7].recv(4) == b"ping"
        for s in (real, *admitted.values()):
            s.close()
    finally:
        listener.close()


def test_admission_refuses_bad_and_duplicate_hellos_and_times_out_naming_the_missing():
    listener = wire.AuthListener("127.0.0.1", b"test")
    try:
        bad = wire.connect(listener.address, listener.key, b"test", (9, b"x"), 5)  # not a hello
        one = wire.connect(listener.address, listener.key, b"test", _hello(1), 5)
        again = wire.connect(listener.address, listener.key, b"test", _hello(1), 5)  # a second "1"
        with pytest.raises(FaultTimeout, match="1 of 2 peers"):
            listener.admit(2, _ident, timeout_s=1.5)
        assert listener.refused == 2
        for s in (bad, one, again):
            s.close()
    finally:
        listener.close()


def test_the_listener_binds_the_address_it_is_given_only():
    listener = wire.AuthListener("127.0.0.1", b"test")
    try:
        assert listener.sock.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()


# -- the frame reader --------------------------------------------------------------------------------


def _roundtrip(payload: bytes, max_bytes: int = 1 << 20) -> wire.Frame | None:
    a, b = socket.socketpair()
    try:
        a.sendall(payload)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        return wire.read_frame(b, "peer", max_bytes)
    finally:
        a.close()
        b.close()


def test_frames_carry_typed_arrays_exactly():
    keys = np.array([1, 2**63 + 5], np.uint64)
    grads = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = _roundtrip(frame_bytes(2, b"meta", [keys, None, grads, np.empty(0, np.float32)]))
    assert got is not None and got.kind == 2 and got.meta == b"meta"
    assert np.array_equal(got.arrays[0], keys) and got.arrays[0].dtype == np.uint64
    assert got.arrays[1] is None
    assert np.array_equal(got.arrays[2], grads) and got.arrays[2].shape == (2, 3)
    assert got.arrays[3].shape == (0,)
    assert _roundtrip(b"") is None  # a clean end between frames
    with pytest.raises(TypeError):
        frame_bytes(2, b"", [np.array(["a"])])


def test_the_reader_refuses_malformed_truncated_and_oversized_frames_unallocated():
    good = frame_bytes(2, b"m", [np.ones(1000, np.float32)])
    with pytest.raises(DataPlaneError, match="oversized"):
        _roundtrip(good, max_bytes=3999)
    assert _roundtrip(good, max_bytes=4000) is not None
    with pytest.raises(DataPlaneError, match="truncated"):
        _roundtrip(good[:-1])
    with pytest.raises(DataPlaneError, match="bad magic"):
        _roundtrip(b"XX" + good[2:])
    huge = struct.pack("<2sBBIQ", b"HF", 2, 1, 0, 8) + struct.pack("<BBQQ", 2, 2, 2**40, 2**40)
    with pytest.raises(DataPlaneError, match="need more"):  # the shape, not the header's length, is refused
        _roundtrip(huge + b"\0" * 8)


def fuzz_frames(rng: random.Random, good: bytes, n: int):
    """``n`` random, truncated, oversized or corrupted variants of the frame ``good``."""
    for i in range(n):
        kind = i % 5
        if kind == 0:
            yield rng.randbytes(rng.randrange(1, 200))
        elif kind == 1:
            yield good[: rng.randrange(1, len(good))]
        elif kind == 2:  # a header claiming a huge body
            yield struct.pack("<2sBBIQ", b"HF", rng.randrange(256), rng.randrange(9), 0, rng.randrange(2**40, 2**64))
        elif kind == 3:  # a byte of the header or descriptors flipped
            b = bytearray(good)
            b[rng.randrange(16 + 1 + 18)] ^= 1 << rng.randrange(8)
            yield bytes(b)
        else:
            yield struct.pack("<2sBBIQ", b"HF", 2, rng.randrange(256), rng.randrange(2**32), rng.randrange(2**20))


def test_fuzzed_frames_end_in_a_typed_error_or_a_valid_frame_never_a_crash_or_a_hang():
    good = frame_bytes(2, b"m", [np.arange(4, dtype=np.uint64), np.ones((4, 2), np.float32)])
    counts = {"refused": 0, "valid": 0}
    for payload in fuzz_frames(random.Random(45), good, 10_000):
        try:
            frame = _roundtrip(payload, max_bytes=1 << 16)
        except DataPlaneError:
            counts["refused"] += 1
            continue
        counts["valid"] += 1  # a flipped bit can leave a consistent frame (another kind, say)
        assert frame is None or sum(a.nbytes for a in frame.arrays if a is not None) <= 1 << 16
    assert counts["refused"] + counts["valid"] == 10_000 and counts["refused"] > 9_000


# -- junk connections against a listener -------------------------------------------------------------


@pytest.mark.slow
def test_ten_thousand_junk_connections_are_refused_and_the_real_peer_still_gets_in():
    listener = wire.AuthListener("127.0.0.1", b"test")
    try:
        good = frame_bytes(*_hello(1), [])
        assert junk_connections(listener.address, 10_000, 1, good) == 10_000
        wait_refused(listener, 10_000)
        real = wire.connect(listener.address, listener.key, b"test", _hello(1), 5)
        admitted = listener.admit(1, _ident, timeout_s=5)
        assert list(admitted) == [1]
        for s in (real, *admitted.values()):
            s.close()
    finally:
        listener.close()


# -- no pickles --------------------------------------------------------------------------------------

_UNPICKLERS = {("pickle", "loads"), ("pickle", "load"), ("pickle", "Unpickler"), ("marshal", "loads")}
_UNPICKLERS |= {("cloudpickle", "loads"), ("cloudpickle", "load"), ("dill", "loads")}


def unpickling_calls(source: str) -> list[int]:
    """Lines of ``source`` that call an unpickler (``pickle.loads``, ``from pickle import loads``...)."""
    tree = ast.parse(source)
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in {m for m, _ in _UNPICKLERS}
        for alias in node.names
        if (node.module, alias.name) in _UNPICKLERS
    }
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in _UNPICKLERS:
                lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in names:
            lines.append(node.lineno)
    return lines


def test_the_check_finds_an_unpickler():
    assert unpickling_calls("import pickle\nx = pickle.loads(sock.recv(9))\n") == [2]
    assert unpickling_calls("from pickle import loads as l\nl(b)\n") == [2]
    assert unpickling_calls("import json\njson.loads(b)\n") == []


def test_no_hpsray_code_unpickles():
    root = pathlib.Path(__file__).resolve().parents[2] / "hpsray"
    found = {
        str(p.relative_to(root)): lines
        for p in sorted(root.rglob("*.py"))
        if (lines := unpickling_calls(p.read_text()))
    }
    assert found == {}
