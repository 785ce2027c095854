"""The data plane's wire: how a connection between hpsray's own processes proves it belongs to
the job, and the typed frames on it (docs/operations.md: Listening sockets). Ray-free.

**Admission.** Every listener holds a key, 32 random bytes made by its owner and handed to the
peers only through Ray (an actor's reply: Ray's control plane, token-authenticated when Ray's
auth is on), never on the connection. Before any frame is read: the listener sends
``CHALLENGE`` and a nonce; the client answers its own nonce and ``HMAC-SHA256(key, "client" |
purpose | both nonces)``; the listener checks it (``hmac.compare_digest``) and answers the
``"server"`` HMAC, which the client checks. A connection that fails, stalls past the handshake
timeout or sends anything else is closed and counted (:attr:`AuthListener.refused`); the
listener goes on serving. Then the client's first frame (its hello) says who it is.

**Frames.** A 16-byte header ``(magic "HF", kind u8, arrays u8, meta bytes u32, data bytes
u64)``, the kind's fixed ``meta`` fields, one descriptor per array ``(dtype code u8, ndim u8,
two dims u64)`` and the arrays' raw bytes, back to back. Never a pickle. A frame whose header,
descriptors or sizes do not add up, or that is larger than the reader's limit, raises
:class:`~hpsray.errors.DataPlaneError` before its body is allocated.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from hpsray.errors import AuthenticationError, DataPlaneError, FaultTimeout

__all__ = [
    "AuthListener",
    "Frame",
    "connect",
    "new_key",
    "read_frame",
    "send_frame",
]

log = logging.getLogger("hpsray.cluster.wire")
_Id = TypeVar("_Id", bound=Hashable)

CHALLENGE = b"HPSRAY-AUTH-1\n\0\0"  # 16 bytes: the protocol and its version
NONCE = 32
DIGEST = 32
HANDSHAKE_TIMEOUT_S = 10.0  # a client that does not answer the challenge within it is refused
MAX_META = 4096
MAX_ARRAYS = 8
DEFAULT_MAX_FRAME = 1 << 33  # 8 GiB: far above any update; a larger length is refused unread

_HEAD = struct.Struct("<2sBBIQ")  # magic, kind, arrays, meta bytes, data bytes
_MAGIC = b"HF"
_ARRAY = struct.Struct("<BBQQ")  # dtype code (0: absent), ndim (0-2), dim 0, dim 1
_DTYPES: dict[int, np.dtype] = {
    c: np.dtype(t) for c, t in ((1, np.uint64), (2, np.float32), (3, np.int64), (4, np.float64))
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


def new_key() -> bytes:
    """A listener's key: 32 bytes from the OS's random source."""
    return secrets.token_bytes(32)


def _mac(key: bytes, role: bytes, purpose: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + b"|" + purpose + b"|" + a + b, hashlib.sha256).digest()


@dataclass
class Frame:
    """One typed frame: ``kind``, its fixed ``meta`` bytes and its arrays (``None``: absent)."""

    kind: int
    meta: bytes
    arrays: list[np.ndarray | None]


def _recv_exact(sock: socket.socket, n: int, peer: str, what: str, eof_ok: bool = False) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise DataPlaneError(peer, f"truncated {what}: the connection ended after {got} of {n} bytes")
        got += k
    return buf


def _recv_into(sock: socket.socket, buf: memoryview, peer: str) -> None:
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise DataPlaneError(peer, f"truncated frame: the connection ended after {got} of {n} data bytes")
        got += k


def send_frame(sock: socket.socket, kind: int, meta: bytes, arrays: Sequence[np.ndarray | None] = ()) -> None:
    """Send one frame (arrays C-contiguous, of the dtypes in ``_DTYPES``, at most 2-D)."""
    descs, datas = [], []
    for a in arrays:
        if a is None:
            descs.append(_ARRAY.pack(0, 0, 0, 0))
            continue
        a = np.ascontiguousarray(a)
        if a.ndim > 2 or a.dtype not in _CODES:
            raise TypeError(f"a frame carries arrays of {sorted(map(str, _CODES))} up to 2-D, not {a.dtype} {a.shape}")
        dims = (*a.shape, 0, 0)[:2]
        descs.append(_ARRAY.pack(_CODES[a.dtype], a.ndim, *dims))
        if a.nbytes:
            datas.append(a.data.cast("B"))
    size = sum(len(d) for d in datas)
    head = _HEAD.pack(_MAGIC, kind, len(descs), len(meta), size) + meta + b"".join(descs)
    if size < 65536:
        sock.sendall(head + b"".join(datas))
        return
    sock.sendall(head)
    for d in datas:
        sock.sendall(d)


def read_frame(
    sock: socket.socket, peer: str, max_bytes: int = DEFAULT_MAX_FRAME, kinds: Sequence[int] | None = None
) -> Frame | None:
    """The next frame on ``sock``; ``None`` when the stream ends cleanly between frames. Raises
    :class:`DataPlaneError` (naming ``peer``) on a malformed, truncated or oversized frame or a
    kind not in ``kinds``; nothing larger than the header's checked sizes is allocated."""
    head = _recv_exact(sock, _HEAD.size, peer, "frame header", eof_ok=True)
    if head is None:
        return None
    magic, kind, n_arrays, n_meta, n_data = _HEAD.unpack(head)
    if magic != _MAGIC:
        raise DataPlaneError(peer, f"malformed frame: bad magic {bytes(magic)!r}")
    if kinds is not None and kind not in kinds:
        raise DataPlaneError(peer, f"frame of kind {kind} where {sorted(kinds)} may come")
    if n_arrays > MAX_ARRAYS or n_meta > MAX_META:
        raise DataPlaneError(peer, f"malformed frame: {n_arrays} arrays, {n_meta} meta bytes")
    if n_data > max_bytes:
        raise DataPlaneError(peer, f"oversized frame: {n_data} data bytes, the limit is {max_bytes}")
    rest = _recv_exact(sock, n_meta + n_arrays * _ARRAY.size, peer, "frame meta")
    assert rest is not None
    meta = bytes(rest[:n_meta])
    shapes: list[tuple[np.dtype, tuple[int, ...]] | None] = []
    total = 0
    for i in range(n_arrays):
        code, ndim, d0, d1 = _ARRAY.unpack_from(rest, n_meta + i * _ARRAY.size)
        if code == 0:
            shapes.append(None)
            continue
        if code not in _DTYPES or ndim > 2 or (ndim < 2 and d1) or (ndim < 1 and d0):
            raise DataPlaneError(peer, f"malformed frame: array {i} has dtype code {code}, ndim {ndim}")
        dt, shape = _DTYPES[code], (d0, d1)[:ndim]
        count = 1
        for d in shape:
            count *= d
        total += count * dt.itemsize
        if total > n_data:
            raise DataPlaneError(peer, f"malformed frame: the arrays need more than the {n_data} data bytes sent")
        shapes.append((dt, shape))
    if total != n_data:
        raise DataPlaneError(peer, f"malformed frame: the arrays need {total} data bytes, the header says {n_data}")
    arrays: list[np.ndarray | None] = []
    for s in shapes:
        if s is None:
            arrays.append(None)
            continue
        a = np.empty(s[1], s[0])
        if a.nbytes:
            _recv_into(sock, a.data.cast("B"), peer)
        arrays.append(a)
    return Frame(kind, meta, arrays)


# -- admission -------------------------------------------------------------------------------------


def connect(
    address: tuple[str, int],
    key: bytes,
    purpose: bytes,
    hello: tuple[int, bytes],
    timeout_s: float,
    peer: str | None = None,
) -> socket.socket:
    """A connection to the listener at ``address`` holding ``key``, both ends proven, and this
    end's ``hello`` frame ``(kind, meta)`` sent; blocking, with ``timeout_s`` on its operations.
    Raises :class:`AuthenticationError` when the listener does not prove the key."""
    peer = peer or f"{address[0]}:{address[1]}"
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = _recv_exact(sock, len(CHALLENGE) + NONCE, peer, "challenge")
        assert got is not None
        if bytes(got[: len(CHALLENGE)]) != CHALLENGE:
            raise AuthenticationError(peer, "the listener sent no hpsray challenge")
        theirs, mine = bytes(got[len(CHALLENGE) :]), secrets.token_bytes(NONCE)
        sock.sendall(mine + _mac(key, b"client", purpose, theirs, mine))
        try:
            proof = _recv_exact(sock, DIGEST, peer, "listener's proof")
        except DataPlaneError:
            raise AuthenticationError(peer, "the listener refused this end's answer (not its key)") from None
        assert proof is not None
        if not hmac.compare_digest(bytes(proof), _mac(key, b"server", purpose, mine, theirs)):
            raise AuthenticationError(peer, "the listener did not prove this job's secret")
        send_frame(sock, hello[0], hello[1])
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class _Challenge:
    """A connection between the challenge and its answer."""

    conn: socket.socket
    peer: str
    nonce: bytes
    deadline: float
    got: bytearray = field(default_factory=bytearray)
    error: str = ""


class AuthListener:
    """A listening socket on ``ip`` (the node's address) that admits only connections proving
    ``key`` (:func:`connect`), in a thread of its own from construction until :meth:`close`.

    :meth:`admit` returns the admitted connections by the identity each one's hello frame gives
    (``identify(frame) -> identity`` raises :class:`DataPlaneError` for a hello it refuses);
    a refused connection (no or wrong key, a bad hello, a duplicate) is closed and counted in
    ``refused``, the last few reasons in ``reasons``.
    """

    def __init__(
        self,
        ip: str,
        purpose: bytes,
        key: bytes | None = None,
        backlog: int = 128,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = 256,
    ) -> None:
        self.key, self.purpose, self.handshake_timeout_s = key or new_key(), purpose, handshake_timeout_s
        self.sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        self.sock.bind((ip, 0))
        self.sock.listen(backlog)
        self.address: tuple[str, int] = (ip, self.sock.getsockname()[1])
        self.refused = 0
        self.reasons: list[str] = []
        self._lock = threading.Lock()
        self.max_pending = max_pending
        self._hellos: queue.SimpleQueue[tuple[socket.socket, Frame, str]] = queue.SimpleQueue()
        self._closed = False
        self.sock.setblocking(False)
        self._sel = selectors.DefaultSelector()  # registered before the thread starts: close() may come at once
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"hpsray-listen-{purpose.decode()}")
        self._thread.start()

    def refuse(self, conn: socket.socket | None, reason: str) -> None:
        """Close ``conn`` and count it (logged: at most the first 5, then every 1000th)."""
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass
        with self._lock:
            self.refused += 1
            self.reasons = [*self.reasons[-4:], reason]
            n = self.refused
        if n <= 5 or n % 1000 == 0:
            log.warning("%s listener %s:%d refused connection %d: %s", self.purpose.decode(), *self.address, n, reason)

    def _accept(self) -> None:
        """The challenges of every connection not yet proven, driven by one selector (a
        junk connection costs no thread); a proven one reads its hello in a thread."""
        sel = self._sel
        pending: dict[socket.socket, _Challenge] = {}
        try:
            while not self._closed:
                for sk, _ in sel.select(timeout=0.2):
                    if sk.data is None:
                        self._new(sel, pending)
                    else:
                        self._answer(sel, pending, sk.data)
                now = time.monotonic()
                for c in [c for c in pending.values() if c.deadline < now]:
                    sel.unregister(c.conn)
                    del pending[c.conn]
                    self.refuse(c.conn, f"{c.peer}: no answer to the challenge within {self.handshake_timeout_s:g} s")
        except (OSError, ValueError):
            pass  # closed
        finally:
            for c in pending.values():
                c.conn.close()
            sel.close()

    def _new(self, sel: selectors.BaseSelector, pending: dict) -> None:
        try:
            conn, addr = self.sock.accept()
        except (BlockingIOError, TimeoutError):
            return
        peer = f"{addr[0]}:{addr[1]}"
        if len(pending) >= self.max_pending:
            self.refuse(conn, f"{peer}: too many connections in their handshake")
            return
        c = _Challenge(conn, peer, secrets.token_bytes(NONCE), time.monotonic() + self.handshake_timeout_s)
        try:
            conn.setblocking(False)
            conn.send(CHALLENGE + c.nonce)  # 48 bytes into an empty socket buffer
        except OSError as e:
            self.refuse(conn, f"{peer}: {e}")
            return
        pending[conn] = c
        sel.register(conn, selectors.EVENT_READ, c)

    def _answer(self, sel: selectors.BaseSelector, pending: dict, c: _Challenge) -> None:
        try:
            got = c.conn.recv(NONCE + DIGEST - len(c.got))
        except BlockingIOError:
            return
        except OSError as e:
            got, c.error = b"", str(e)
        if got:
            c.got += got
            if len(c.got) < NONCE + DIGEST:
                return
        sel.unregister(c.conn)
        del pending[c.conn]
        if len(c.got) < NONCE + DIGEST:
            self.refuse(c.conn, f"{c.peer}: {c.error or 'ended'} after {len(c.got)} bytes of its answer")
            return
        theirs, digest = bytes(c.got[:NONCE]), bytes(c.got[NONCE:])
        if not hmac.compare_digest(digest, _mac(self.key, b"client", self.purpose, c.nonce, theirs)):
            self.refuse(c.conn, f"{c.peer}: wrong answer to the challenge (not this job's secret)")
            return
        threading.Thread(target=self._hello, args=(c.conn, c.peer, theirs, c.nonce), daemon=True).start()

    def _hello(self, conn: socket.socket, peer: str, theirs: bytes, mine: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self.handshake_timeout_s)
            conn.sendall(_mac(self.key, b"server", self.purpose, theirs, mine))
            hello = read_frame(conn, peer, max_bytes=0)
            if hello is None:
                raise DataPlaneError(peer, "ended before its hello")
            self._hellos.put((conn, hello, peer))
        except (DataPlaneError, OSError) as e:
            self.refuse(conn, str(e))

    def admit(self, expected: int, identify: Callable[[Frame], _Id], timeout_s: float) -> dict[_Id, socket.socket]:
        """The first ``expected`` connections with distinct identities, each blocking with no
        timeout set; :class:`~hpsray.errors.FaultTimeout` after ``timeout_s`` without them."""
        out: dict[_Id, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FaultTimeout(
                        f"{expected - len(out)} of {expected} peers to connect to {self.address[0]}:{self.address[1]} "
                        f"({self.purpose.decode()}; {self.refused} connections refused: {self.reasons[-1:]})",
                        timeout_s,
                    )
                try:
                    conn, hello, peer = self._hellos.get(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                try:
                    who = identify(hello)
                except DataPlaneError as e:
                    self.refuse(conn, f"{peer}: {e.reason}")
                    continue
                if who in out:
                    self.refuse(conn, f"{peer}: a second connection as {who!r}")
                    continue
                conn.settimeout(None)
                out[who] = conn
        except BaseException:
            for s in out.values():
                s.close()
            raise
        return out

    def close(self) -> None:
        """Stop listening (the admitted connections stay open)."""
        self._closed = True
        self.sock.close()
        self._thread.join(timeout=2.0)
        while True:
            try:
                conn, _, _ = self._hellos.get_nowait()
            except queue.Empty:
                return
            conn.close()
