"""A listening socket served by one accept thread; a connection gets a thread of its own
only once its hello has passed.

The hello proves the token without sending it: on accept the server sends a 16-byte nonce,
the client answers magic | HMAC-SHA256(token, magic | nonce) (32 bytes), compared in
constant time. A sniffer on the link learns neither the token nor a reusable answer.

Used by the shm fd server (unix socket) and the tcp/gloo data servers. Connections that
have not passed their hello are handled in the accept thread itself (non-blocking reads):
at most `max_pending` at a time (the oldest is dropped for a new one), each with a
`hello_timeout_s` deadline and at most `max_hello_bytes` read. So a stranger who opens
thousands of idle sockets costs a bounded set of file descriptors and no threads.
`close()` wakes the accept loop through a socketpair instead of relying on a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from omni.ratelog import RateLimitedLog
from omni.transport.base import TransportError

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
HELLO_BYTES = 4 + 32               # magic | HMAC-SHA256
MAX_PENDING = 64
HELLO_TIMEOUT_S = 5.0

# hello(conn, bytes so far, nonce sent) -> None: need more; True: admit; False: refuse.
Hello = Callable[[socket.socket, bytes, bytes], "bool | None"]


def hello_answer(magic: bytes, token: str | bytes | None, nonce: bytes) -> bytes:
    key = token.encode() if isinstance(token, str) else (token or b"")
    return magic + hmac.new(key, magic + nonce, hashlib.sha256).digest()


def token_hello(magic: bytes, token: bytes) -> Hello:
    """The hello every data server uses. The client waits for the server's status, so
    nothing may follow the answer."""
    def check(conn: socket.socket, buf: bytes, nonce: bytes) -> bool | None:
        if len(buf) < HELLO_BYTES:
            return None if buf[:len(magic)] == magic[:len(buf)] else False   # the MAC part is checked whole
        return len(buf) == HELLO_BYTES and hmac.compare_digest(buf, hello_answer(magic, token, nonce))
    return check


def client_hello(sock: socket.socket, magic: bytes, token: str | None) -> None:
    """The client's half: read the nonce, answer it (the caller then reads the status)."""
    from omni.transport.util import recv_exact

    sock.sendall(hello_answer(magic, token, recv_exact(sock, NONCE_BYTES)))


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def check_listener_user(sock: socket.socket, what: str) -> None:
    """A client's check before the hello: an abstract name can be bound by any user on the host,
    and a listener of another user could answer in our listener's place."""
    if peer_uid(sock) != os.getuid():
        raise TransportError(f"{what} is held by another user")


@contextlib.contextmanager
def hello_guard(sock: socket.socket, what: str):
    """Close `sock` on any failure of the connect or hello; socket errors say `what` is unreachable."""
    try:
        yield
    except OSError as e:
        sock.close()
        raise TransportError(f"{what} unreachable: {e}") from e
    except BaseException:
        sock.close()
        raise


def connect_same_user(name: str, kind: int, magic: bytes, token: str | None, timeout: float,
                      what: str) -> socket.socket:
    """A connected socket to the same_user_server at abstract `name` that passed the token hello:
    the listener's user checked, the status byte read (0: admitted). TransportError names the cause."""
    sock = socket.socket(socket.AF_UNIX, kind)
    with hello_guard(sock, what):
        sock.settimeout(timeout)
        sock.connect("\0" + name)
        check_listener_user(sock, what)   # else it could answer in our listener's place
        client_hello(sock, magic, token)
        status = sock.recv(1)
    if status != b"\0":
        sock.close()
        raise TransportError(f"{what} refused the connection (bad token, or another user)")
    return sock


def same_user_server(name: str, kind: int, handler: Callable[[socket.socket], None], server_name: str, *,
                     magic: bytes, token: str | None, refusal: bytes) -> SocketServer:
    """A SocketServer at the abstract unix name `name` (`kind`: SOCK_STREAM or SOCK_SEQPACKET)
    that admits a peer only if it runs as this user (SO_PEERCRED) and passes the token hello
    for `magic`; a refused one gets `refusal`. OSError if the name cannot be bound."""
    sock = socket.socket(socket.AF_UNIX, kind)
    try:
        sock.bind("\0" + name)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    token_ok = token_hello(magic, (token or "").encode())

    def hello(conn: socket.socket, buf: bytes, nonce: bytes) -> bool | None:
        return token_ok(conn, buf, nonce) if peer_uid(conn) == os.getuid() else False

    return SocketServer(sock, handler, server_name, hello=hello, refusal=refusal)


class _Pending:
    __slots__ = ("buf", "deadline", "nonce")

    def __init__(self, deadline: float):
        self.buf = b""
        self.deadline = deadline
        self.nonce = secrets.token_bytes(NONCE_BYTES)


class SocketServer:
    def __init__(self, sock: socket.socket, handler: Callable[[socket.socket], None], name: str, *,
                 hello: Hello, refusal: bytes = b"", max_pending: int = MAX_PENDING,
                 hello_timeout_s: float = HELLO_TIMEOUT_S, max_hello_bytes: int = HELLO_BYTES):
        self._sock = sock
        self._handler = handler
        self._name = name
        self._hello = hello
        self._refusal = refusal
        self._max_pending = max_pending
        self._hello_timeout = hello_timeout_s
        self._max_hello = max_hello_bytes
        self._refused = RateLimitedLog(logger)
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()
        self._closed = False
        self._sock.setblocking(False)
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                timeout = None
                if self._pending:
                    timeout = max(0.0, next(iter(self._pending.values())).deadline - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._sock:
                        self._accept(sel)
                    else:
                        self._read_hello(sel, key.fileobj)
                now = time.monotonic()
                while self._pending:
                    conn, p = next(iter(self._pending.items()))
                    if p.deadline > now:
                        break
                    self._drop(sel, conn, "no hello within %.0f s" % self._hello_timeout)
        finally:
            for conn in list(self._pending):
                self._drop(sel, conn, None)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(self._max_pending):   # drain the kernel's queue, so a flood finds it short
            try:
                conn, _addr = self._sock.accept()
            except OSError as e:   # EAGAIN (queue empty), EMFILE ...
                if not isinstance(e, BlockingIOError):
                    logger.debug("%s: accept failed: %s", self._name, e)
                return
            self._admit(sel, conn)

    def _admit(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        if len(self._pending) >= self._max_pending:
            # The oldest waiter is the likeliest idle one: a real client sends its hello at once.
            self._drop(sel, next(iter(self._pending)), "too many connections without a hello")
        conn.setblocking(False)
        p = self._pending[conn] = _Pending(time.monotonic() + self._hello_timeout)
        try:
            conn.send(p.nonce)     # 16 bytes into a fresh socket's empty buffer
        except OSError:
            self._drop(sel, conn, None)
            return
        sel.register(conn, selectors.EVENT_READ)

    def _read_hello(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        p = self._pending.get(conn)
        if p is None:
            return
        try:
            data = conn.recv(self._max_hello - len(p.buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, conn, None)
            return
        p.buf += data
        verdict = self._hello(conn, p.buf, p.nonce)
        if verdict is None and len(p.buf) < self._max_hello:
            return
        if not verdict:
            if self._refusal:
                try:
                    conn.send(self._refusal)
                except OSError:
                    pass
            self._drop(sel, conn, "bad hello or token")
            return
        sel.unregister(conn)
        del self._pending[conn]
        conn.setblocking(True)
        with self._lock:
            if self._closed:
                conn.close()
                return
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True)
            self._conns[conn] = thread
        thread.start()

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket, why: str | None) -> None:
        self._pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        if why:
            try:
                peer = conn.getpeername()
            except OSError:
                peer = "?"
            self._refused.warning("%s: refused a connection from %s: %s", self._name, peer, why)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handler(conn)
        except (ConnectionError, OSError) as e:
            logger.debug("%s: connection ended: %s", self._name, e)
        except Exception:
            logger.exception("%s: connection handler failed", self._name)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # let handlers unwind (and drop what they hold, e.g. process groups) before we return
        for thread in conns.values():
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
