"""The frontends speak HTTP/1.1 only (omni/api/http1.py): an HTTP/2 connection escaped Hypercorn's
keep-alive timer and stayed open for good. Real sockets on 127.0.0.1: the timer is Hypercorn's."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from omni.api.limits import HttpLimits
from tests.unit.api_fakes import served_in_thread

KEEP_ALIVE = 0.5
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


SETTINGS = frame(4, 0, 0)
PING = frame(6, 0, 0, b"\0" * 8)


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server():
    """(host, port) of `serve` on a thread's loop, keep-alive timer KEEP_ALIVE."""
    with served_in_thread(hello, HttpLimits(timeout_keep_alive=KEEP_ALIVE)) as addr:
        yield addr


def read_until_closed(sock: socket.socket, deadline_s: float, *, every: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when; fails at the deadline.
    `every`, if given, is sent every 0.1 s meanwhile (a client keeping the connection busy)."""
    t0 = time.monotonic()
    got = b""
    sock.settimeout(0.1)
    while time.monotonic() - t0 < deadline_s:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            if every:
                try:
                    sock.sendall(every)
                except OSError:      # the server closed: the next recv says so
                    pass
            continue
        except ConnectionResetError:
            return got, time.monotonic() - t0
        if not data:
            return got, time.monotonic() - t0
        got += data
    pytest.fail(f"still open after {deadline_s} s; received {got[:200]!r}")


def test_the_http2_preface_is_refused_and_the_connection_closed(server):
    with socket.create_connection(server) as s:
        s.sendall(PREFACE + SETTINGS)
        got, _ = read_until_closed(s, 10 * KEEP_ALIVE + 5)
    assert got.startswith(b"HTTP/1.1 505 "), got


def test_an_http2_connection_sending_pings_is_closed(server):
    with socket.create_connection(server) as s:
        s.sendall(PREFACE + SETTINGS)
        got, _ = read_until_closed(s, 10 * KEEP_ALIVE + 5, every=PING)
    assert got.startswith(b"HTTP/1.1 505 "), got


def test_an_h2c_upgrade_is_answered_in_http11_and_then_falls_under_the_keep_alive_timer(server):
    with socket.create_connection(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                  b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        got, _ = read_until_closed(s, 10 * KEEP_ALIVE + 5)   # idle after the answer: the timer closes it
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"ok"), got
    assert b"101" not in got.split(b"\r\n")[0]


def test_http11_keep_alive_still_works(server):
    with socket.create_connection(server) as s:
        for _ in range(2):
            s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            s.settimeout(5)
            got = b""
            while not got.endswith(b"ok"):
                got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200 ")
        _, after = read_until_closed(s, 10 * KEEP_ALIVE + 5)
    assert after >= KEEP_ALIVE * 0.5
