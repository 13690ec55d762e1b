"""HTTP/1.1 only on the frontends, as vLLM's uvicorn server: Hypercorn's cleartext HTTP/2 is refused.

Hypercorn stops its keep-alive timer when a request head arrives and HTTP/2 restarts it only when a
stream ends, so an HTTP/2 connection that opens no stream (or only PINGs, or sends an endless header
block) was never closed: anyone could hold the frontend's file descriptors. Hypercorn has no setting
for this (its h2 is always on), so its TCP server is given a protocol wrapper that only speaks
HTTP/1.1: the prior-knowledge preface gets a 505 and the connection closes; an `Upgrade: h2c` is
ignored (RFC 9110 lets a server) and the request answered in HTTP/1.1. Written against Hypercorn
0.18.0 (pinned): tests/unit/test_http1_only.py checks it on a real socket.
"""

from __future__ import annotations

import hypercorn.asyncio.tcp_server as _tcp_server
from hypercorn.events import Closed
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol


class _Http2Refused(Exception):
    pass


class _H11Only(H11Protocol):
    async def _check_protocol(self, event) -> None:
        if event.method == b"PRI" and event.target == b"*":   # HTTP/2 with prior knowledge
            await self._send_error_response(505)
            raise _Http2Refused
        # Anything else, `Upgrade: h2c` included, is served as the HTTP/1.1 request it is.


class Http11OnlyWrapper(ProtocolWrapper):
    def __init__(self, app, config, context, task_group, state, ssl, client, server, send, alpn_protocol=None):
        super().__init__(app, config, context, task_group, state, ssl, client, server, send, "http/1.1")
        self.protocol = _H11Only(app, config, context, task_group, state, ssl, client, server, send)

    async def handle(self, event) -> None:
        try:
            await self.protocol.handle(event)
        except _Http2Refused:
            await self.send(Closed())


def install() -> None:
    """Every Hypercorn TCP connection in this process speaks HTTP/1.1 only (omni serves HTTP with
    Hypercorn nowhere else)."""
    _tcp_server.ProtocolWrapper = Http11OnlyWrapper
