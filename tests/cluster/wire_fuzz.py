"""Test helpers of the data plane's fuzz tests (tests/cluster/test_wire.py, test_push_stream.py,
test_aggregation.py): frames as bytes, and junk connections that never prove the key."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

from hpsray.cluster import wire


def frame_bytes(kind: int, meta: bytes, arrays) -> bytes:
    a, b = socket.socketpair()
    try:
        wire.send_frame(a, kind, meta, arrays)
        a.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := b.recv(1 << 16):
            out += chunk
        return out
    finally:
        a.close()
        b.close()


def junk_connections(address: tuple[str, int], n: int, seed: int, good_frame: bytes, threads: int = 4) -> int:
    """Open ``n`` connections to ``address`` that never prove the key: closed at once, random
    bytes, a well-formed frame, an oversized frame header, a wrong or truncated answer to the
    challenge. Returns how many were made."""
    made = [0] * threads

    def run(t: int) -> None:
        rng = random.Random(seed * 100 + t)
        for i in range(t, n, threads):
            try:
                s = socket.create_connection(address, timeout=10)
            except OSError:
                continue
            try:
                kind = i % 6
                if kind == 1:
                    s.sendall(rng.randbytes(rng.randrange(1, 300)))
                elif kind == 2:
                    s.sendall(good_frame)
                elif kind == 3:
                    s.sendall(struct.pack("<2sBBIQ", b"HF", 2, 3, 0, 2**62))
                elif kind == 4:
                    s.recv(len(wire.CHALLENGE) + wire.NONCE)
                    s.sendall(rng.randbytes(wire.NONCE + wire.DIGEST))
                elif kind == 5:
                    s.sendall(rng.randbytes(rng.randrange(1, wire.NONCE + wire.DIGEST)))
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                s.close()
            made[t] += 1

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(made)


def wait_refused(listener: wire.AuthListener, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while listener.refused < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.refused == n
