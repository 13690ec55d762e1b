"""Same-host message channel: an abstract-namespace unix SEQPACKET socket.

Carries small messages (tensor refs, acks) between two processes of one user on one host
without ZMQ: one send and one receive syscall per message, the kernel's wake-up as the
doorbell. Measured here (benchmarks/transport.py) a round trip takes a fraction of a ZMQ
PAIR's, whose messages cross libzmq's I/O thread on each side, and CURVE adds its crypto.

Security is that of the shm fd server: the listener admits a peer only if it runs as the
same user (SO_PEERCRED) and passes the token hello (nonce + HMAC, server.py); the client
checks the listener's user too, so another user cannot squat the name and feed it messages.
Nothing is named in the filesystem; the abstract name goes with the listener.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import queue
import secrets
import select
import socket
import struct
import termios
import time
from typing import Callable

from omni import envs
from omni.transport.base import TransportError
from omni.transport.server import (
    NONCE_BYTES, check_listener_user, connect_same_user, hello_answer, hello_guard, same_user_server,
)
from omni.transport.util import spin_until

MAGIC = b"OML1"
_STATUS = struct.Struct("<B")   # hello reply: 0 ok, 1 refused
MAX_MESSAGE_BYTES = 64 << 10    # refs and acks only; tensors travel apart


class PeerClosed(TransportError):
    """A send found the peer's end closed (it stopped or restarted): an end, not a fault."""


class LocalChannel:
    """One end of a connected channel; messages keep their boundaries and order."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._sock.setblocking(True)
        self._fd = sock.fileno()
        self._inq = array.array("i", [0])
        self.closed = False
        self.spin_us = envs.OMNI_SPIN_US    # recv's default, read once (not on each call)

    def fileno(self) -> int:
        """Readable when a message (or the peer's close) is waiting: for poll or asyncio add_reader."""
        return self._sock.fileno()

    def send(self, data: bytes, wait: bool = True) -> bool:
        """Queue one message. With wait=False a full socket buffer (a peer that does not read)
        returns False instead of blocking, so a loop can hold the message and retry."""
        if not data:
            raise TransportError("local channel: empty messages are reserved for end of stream")
        if len(data) > MAX_MESSAGE_BYTES:
            raise TransportError(f"local channel: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            self._sock.send(data, 0 if wait else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerClosed(f"local channel: send failed: {e}") from e
        except OSError as e:
            raise TransportError(f"local channel: send failed: {e}") from e
        return True

    def recv(self, timeout: float | None = None, spin_us: int | None = None) -> bytes:
        """The next message; TimeoutError past `timeout`, ConnectionError once the peer closed.
        Polls for up to `spin_us` (default OMNI_SPIN_US) before it blocks: a reply that lands
        meanwhile costs no wake-up (about 30 us each way where idle vCPUs halt)."""
        spin_s = (self.spin_us if spin_us is None else spin_us) / 1e6
        if spin_s > 0:
            start = time.perf_counter()
            data = spin_until(lambda: self.recv_nowait() if self.waiting() else None,
                              spin_s if timeout is None else min(spin_s, timeout))
            if data is not None:
                return data
            if timeout is not None:
                timeout = max(0.0, timeout - (time.perf_counter() - start))
        if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
            raise TimeoutError(f"local channel: no message within {timeout} s")
        try:
            data = self._sock.recv(MAX_MESSAGE_BYTES + 1)
        except OSError as e:
            raise ConnectionError(f"local channel: receive failed: {e}") from e
        if not data:
            raise ConnectionError("local channel: the peer closed it")
        return data

    def recv_nowait(self) -> bytes | None:
        """The next message if one is waiting, else None; ConnectionError once the peer closed."""
        try:
            data = self._sock.recv(MAX_MESSAGE_BYTES + 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError as e:
            raise ConnectionError(f"local channel: receive failed: {e}") from e
        if not data:
            raise ConnectionError("local channel: the peer closed it")
        return data

    def waiting(self) -> bool:
        """Whether a message waits (not: whether the peer closed). One ioctl, a third of the
        failed `recv_nowait` (its exception's message is built from strerror) that would tell."""
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, self._inq, True)   # a packet socket: the next one's size
        except OSError:
            return True     # the next recv_nowait reports it
        return self._inq[0] > 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


class LocalListener:
    """Accepts channels at an abstract name (`self.name`); `accept()` returns the next one.
    `on_accept()` (from the listener's thread) says one is waiting, e.g. to wake a poll loop."""

    def __init__(self, token: str | None = None, name: str | None = None,
                 on_accept: Callable[[], None] | None = None):
        self.name = name or f"omni-local-{os.getpid()}-{secrets.token_hex(6)}"
        self._on_accept = on_accept
        self._accepted: queue.Queue[LocalChannel] = queue.Queue()
        try:
            self._server = same_user_server(self.name, socket.SOCK_SEQPACKET, self._serve, "omni-local",
                                            magic=MAGIC, token=token, refusal=_STATUS.pack(1))
        except OSError as e:
            raise TransportError(f"local channel {self.name}: cannot listen: {e}") from e

    def _serve(self, conn: socket.socket) -> None:
        # The server closes `conn` when this returns: the channel keeps a duplicate.
        conn.sendall(_STATUS.pack(0))
        self._accepted.put(LocalChannel(conn.dup()))
        if self._on_accept is not None:
            self._on_accept()

    def accept(self, timeout: float | None = None) -> LocalChannel:
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"local channel {self.name}: no peer within {timeout} s") from None

    def accept_nowait(self) -> LocalChannel | None:
        try:
            return self._accepted.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self._server.close()
        while not self._accepted.empty():
            self._accepted.get_nowait().close()


def _admitted(sock: socket.socket, name: str, status: bytes) -> LocalChannel:
    if status != _STATUS.pack(0):
        sock.close()
        raise TransportError(f"local channel {name} refused the connection (bad token, or another user)")
    return LocalChannel(sock)


def connect_local(name: str, token: str | None = None, timeout: float = 10.0) -> LocalChannel:
    """Connect to a LocalListener of this user; TransportError if refused or unreachable."""
    return LocalChannel(connect_same_user(name, socket.SOCK_SEQPACKET, MAGIC, token, timeout, f"local channel {name}"))


async def connect_local_async(name: str, token: str | None = None, timeout: float = 1.0) -> LocalChannel:
    """connect_local without blocking the event loop: the connect is non-blocking (a unix
    connect completes at once, or fails when the listener's queue is full) and the hello's two
    reads wait on the loop, so a listener that is alive but does not answer (a stopped process)
    costs the loop nothing; TransportError past `timeout`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    with hello_guard(sock, f"local channel {name}"):
        try:
            async with asyncio.timeout(timeout):
                sock.connect("\0" + name)
                check_listener_user(sock, f"local channel {name}")
                nonce = await loop.sock_recv(sock, NONCE_BYTES)     # a packet socket: the whole nonce or nothing
                if len(nonce) != NONCE_BYTES:
                    raise TransportError(f"local channel {name} closed the connection during its hello")
                sock.send(hello_answer(MAGIC, token, nonce))        # 36 bytes into an empty buffer
                status = await loop.sock_recv(sock, _STATUS.size)
        except TimeoutError:   # an OSError too: answered here, before the guard's wording
            raise TransportError(f"local channel {name}: no hello within {timeout:g} s") from None
    return _admitted(sock, name, status)
