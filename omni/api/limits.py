"""The HTTP frontend's bounds on what a client can make it hold: request body size (refused
from Content-Length before a byte is read; a chunked body is cut off at the cap), the time a
request body may take to arrive, the wait for a request's head (Hypercorn's keep-alive timer,
which runs from accept and from each response until the next head is complete), the wait for one
write of a response to be taken (a client that stops reading: a whole body here, a stream's chunk in
http.ClosingStream; the connection then closes, omni.api.http1) and the listen backlog. A stream's
length is never timed: a client that keeps reading keeps it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

from omni.api.browser import allowed_host_ok
from omni.api.errors import APIError, error_response
from omni.errors import ConfigError

log = logging.getLogger(__name__)

MIB = 1 << 20
WRITE_PIECE = 64 * 1024   # Hypercorn's writer waits in drain() above 64 KiB buffered
WRITE_TIMEOUT = "omni.timeout_response_write"   # the scope key ClosingStream reads it from


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = 16 * MIB      # --max-request-bytes
    timeout_keep_alive: float = 5.0        # --timeout-keep-alive: idle connection / wait for a request head
    timeout_request_body: float = 60.0     # --timeout-request-body: head received -> whole body received
    timeout_response_write: float = 60.0   # --timeout-response-write: one chunk of a stream taken by the client
    backlog: int = 2048                    # --backlog: listen() queue of the HTTP socket
    shutdown_timeout: int | None = None    # --shutdown-timeout: a stop's drain of in-flight requests (None: 5 s)
    # vLLM's CORS flags (omni/api/cors.py): no origin answered unless --allowed-origins names some
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # --allowed-hosts: Host names a keyless server answers on a loopback address (browser.host_refusal)
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        for flag, value, low in (("--max-request-bytes", self.max_request_bytes, 1024),
                                 ("--timeout-keep-alive", self.timeout_keep_alive, 0.1),
                                 ("--timeout-request-body", self.timeout_request_body, 0.1),
                                 ("--timeout-response-write", self.timeout_response_write, 0.1),
                                 ("--backlog", self.backlog, 1)):
            if not value >= low:
                raise ConfigError(f"{flag} must be at least {low}, got {value}")
        hosts = self.allowed_hosts
        if len(hosts) > 64 or not all(isinstance(h, str) and 0 < len(h) <= 253 and allowed_host_ok(h) for h in hosts):
            raise ConfigError(f"--allowed-hosts takes 1-64 host names (a.example; .b.example or *.b.example for its "
                              f"subdomains too; '*' for any), got {str(list(hosts))[:200]}")
        n = self.shutdown_timeout
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"--shutdown-timeout must be a whole number of seconds >= 0, got {n!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "HttpLimits":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in (d or {}).items()})


def too_large(size: int | str, limit: int) -> APIError:
    return APIError(413, f"request body is {size} bytes; this server takes at most {limit} "
                         f"(--max-request-bytes)", code="request_too_large")


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {seconds:g} s (--timeout-request-body)",
                    code="request_timeout")


class WriteTimeout(Exception):
    """A write of the response not taken in time (not a TimeoutError: the body's own must pass)."""


def timed_send(send, timeout: float):
    async def timed(message):
        try:
            async with asyncio.timeout(timeout):   # Hypercorn's send waits in drain() while the client reads nothing
                await send(message)
        except TimeoutError:
            raise WriteTimeout from None
    return timed


def in_pieces(send):
    """A whole body goes out in WRITE_PIECE pieces, each its own write: the deadline is on the client's
    progress (nginx's send_timeout), not on the time a slow link takes for all of it."""
    async def pieces(message):
        body = message.get("body", b"")
        if message["type"] != "http.response.body" or len(body) <= WRITE_PIECE:
            return await send(message)
        view, more = memoryview(body), message.get("more_body", False)
        for at in range(0, len(view), WRITE_PIECE):
            await send({"type": "http.response.body", "body": view[at:at + WRITE_PIECE],
                        "more_body": more or at + WRITE_PIECE < len(view)})
    return pieces


class LimitsMiddleware:
    """Refuse a declared body over the cap before reading it; count what arrives, and bound the
    time until the body is complete. The errors are raised from `receive`, inside the route, so
    they answer as OpenAI error bodies; Hypercorn then closes the connection (body unread). Each
    write of the response waits at most --timeout-response-write for the client to take it."""

    def __init__(self, app, *, limits: HttpLimits):
        self.app = app
        self.limit = limits.max_request_bytes
        self.timeout = limits.timeout_request_body
        self.write_timeout = limits.timeout_response_write

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[WRITE_TIMEOUT] = self.write_timeout
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size > self.limit:
                e = too_large(size, self.limit)
                return await error_response(e.status, e.message, e.type, code=e.code)(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout   # the loop's clock, for timeout_at
        received = 0
        complete = False

        async def limited_receive():
            nonlocal received, complete
            if complete:   # after the body only a disconnect comes: streaming responses wait on it untimed
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise body_timeout(self.timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large(f"more than {self.limit}", self.limit)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        try:
            await self.app(scope, limited_receive, in_pieces(timed_send(send, self.write_timeout)))
        except WriteTimeout:   # a whole body (a stream's chunk is ClosingStream's): the connection closes
            log.info("%s: the client took no data for %g s (--timeout-response-write); response ended",
                     scope["path"], self.write_timeout)
