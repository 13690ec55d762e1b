"""HTTP/1.1 only on the frontends, as vLLM's uvicorn server: Hypercorn's cleartext HTTP/2 is refused.

Hypercorn stops its keep-alive timer when a request head arrives and HTTP/2 restarts it only when a
stream ends, so an HTTP/2 connection that opens no stream (or only PINGs, or sends an endless header
block) was never closed: anyone could hold the frontend's file descriptors. Hypercorn has no setting
for this (its h2 is always on), so its TCP server is given a protocol wrapper that only speaks
HTTP/1.1: the prior-knowledge preface gets a 505 and the connection closes; an `Upgrade: h2c` is
ignored (RFC 9110 lets a server) and the request answered in HTTP/1.1. Written against Hypercorn
0.18.0 (pinned): tests/unit/test_http1_only.py checks it on a real socket.

A head (request line and headers) over h11_max_incomplete_size (16 KiB) is a 431 and the connection closes:
h11 applies that cap only while the head is incomplete, and Hypercorn reads 64 KiB at a time, so a head
arriving in one read passed up to ~64 KiB (tests/unit/test_http1_head_cap.py). The head is sized as parsed:
the whitespace h11 strips around values is not counted, so a padded head is bounded by the 64 KiB read.

A response the app ends before its last byte (a client that took no data within --timeout-response-write,
a raw audio stream cut at the stop) closes the connection: Hypercorn kept it open, waiting, with what the
client had not read still buffered. What a client that is not reading still has queued is dropped with a
reset (a plain close would wait for it to be read); tests/unit/test_api_write_timeout.py checks it.
A request pipelined behind one whose connection ends no longer holds the connection's task for good
(tests/unit/test_http1_pipelined.py).
"""

from __future__ import annotations

import socket
import struct

import h11
import hypercorn.asyncio.tcp_server as _tcp_server
from hypercorn.events import Closed
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol


class _Refused(Exception):
    pass


def head_size(event: h11.Request) -> int:
    """The head's bytes as sent without extra whitespace: request line, `name: value` lines, blank line."""
    return len(event.method) + len(event.target) + 12 + sum(len(k) + len(v) + 4 for k, v in event.headers.raw_items()) + 2


class _H11Only(H11Protocol):
    async def _check_protocol(self, event) -> None:
        if event.method == b"PRI" and event.target == b"*":   # HTTP/2 with prior knowledge
            await self._send_error_response(505)
            raise _Refused
        # h11 caps a head only while it is incomplete: one that came whole in a read (64 KiB) passed any size.
        if head_size(event) > self.config.h11_max_incomplete_size:
            await self._send_error_response(431)
            raise _Refused
        # Anything else, `Upgrade: h2c` included, is served as the HTTP/1.1 request it is.

    async def stream_send(self, event) -> None:
        if isinstance(event, StreamClosed) and self.connection.our_state is h11.SEND_BODY:
            await self._close_stream()      # the app ended an unfinished response: nothing can follow it
            transport = getattr(getattr(getattr(self.send, "__self__", None), "writer", None), "transport", None)
            if transport is not None and transport.get_write_buffer_size():
                sock = transport.get_extra_info("socket")
                if sock is not None:        # the kernel's queue goes too: an RST, not a FIN behind unread data
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            else:
                await self.send(Closed())
        else:
            await super().stream_send(event)
        if isinstance(event, StreamClosed) and self.connection.our_state is not h11.IDLE:
            await self._end_reading()       # not recycled (cut, ended, shutting down): no request follows

    async def handle(self, event) -> None:
        await super().handle(event)
        if isinstance(event, Closed):       # the peer left or a write failed
            await self._end_reading()

    async def _end_reading(self) -> None:
        """End a reader paused behind a pipelined request: h11 answers PAUSED until our response is DONE
        and Hypercorn sets can_read only to recycle, so once the connection ended its reader (and the
        connection's task) waited for good."""
        self.connection.next_event = lambda: h11.ConnectionClosed()
        await self.can_read.set()


class Http11OnlyWrapper(ProtocolWrapper):
    def __init__(self, app, config, context, task_group, state, ssl, client, server, send, alpn_protocol=None):
        super().__init__(app, config, context, task_group, state, ssl, client, server, send, "http/1.1")
        self.protocol = _H11Only(app, config, context, task_group, state, ssl, client, server, send)

    async def handle(self, event) -> None:
        try:
            await self.protocol.handle(event)
        except _Refused:
            await self.send(Closed())


def install() -> None:
    """Every Hypercorn TCP connection in this process speaks HTTP/1.1 only (omni serves HTTP with
    Hypercorn nowhere else)."""
    _tcp_server.ProtocolWrapper = Http11OnlyWrapper
