"""HTTP plumbing shared by every route: the middleware (frontend header, bearer auth, control
route guard, request metrics), error bodies for every failure, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import time
from typing import Awaitable, Callable, Sequence

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from omni.api import browser, routes, sse
from omni.api.errors import APIError, api_error_response, error_body, error_response
from omni.api.limits import WRITE_TIMEOUT, HttpLimits, WriteTimeout, timed_send
from omni.api.metrics import FrontendMetrics
from omni.api.openapi import KEYED_PATHS

log = logging.getLogger(__name__)


class FrontendMiddleware:
    """X-Omni-Frontend on every response, bearer auth on /v1 (and on control routes), request metrics.

    `fast`: (method, path) -> () -> (status, JSON body), answered here for requests without a
    body, past auth, without Starlette's routing and the limits layer (nothing is read): health
    probes and model lists come often, and each layer costs a few percent of a request's time."""

    def __init__(self, app, *, frontend_index: int, api_key: str | Sequence[str] | None, metrics: FrontendMetrics,
                 control_api_key: str | None = None, control_routes: bool = True,
                 fast: dict[tuple[str, str], Callable[[], tuple[int, bytes]]] | None = None,
                 allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = (),
                 streams: set | None = None, in_flight: set | None = None):
        self.app = app
        self.streams = streams                         # open streams' watches, ended at the server's stop
        self.in_flight = in_flight                     # requests' InFlight, answered 503 at the stop if unanswered
        self.allowed_origins = frozenset(allowed_origins)   # --allowed-origins: cross-site pages let in
        self.allowed_hosts = browser.allowed_host_names(allowed_hosts)   # --allowed-hosts, /etc/hosts, this host
        self.fast = fast or {}
        self.header = (b"x-omni-frontend", str(frontend_index).encode())
        self.key = _bearer_digests(api_key)            # None: no key, /v1 is open
        self.control_key = _bearer_digests(control_api_key)
        self.control_routes = control_routes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        fast = self.fast.get((scope["method"], scope["path"]))
        if fast is not None and not _has_body(scope) and self._refusal(scope) is None:
            return await self._answer(scope["path"], fast, send, t0)
        scope["omni.t0"] = t0
        if self.streams is not None:
            scope[OPEN_STREAMS] = self.streams
        route = routes.label(scope["path"])
        status = 500
        self.metrics.started()
        flight = InFlight(self.in_flight)

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                flight.started = True
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send_wrapper)
            try:
                await self.app(scope, receive, send_wrapper)
            except asyncio.CancelledError:
                if not flight.ours():
                    raise
                await api_error_response(SHUTTING_DOWN)(scope, receive, send_wrapper)
        finally:
            flight.close()
            self.metrics.finished(route, status, time.monotonic() - t0)

    async def _answer(self, path: str, fast, send, t0: float) -> None:
        status = 500
        self.metrics.started()
        try:
            status, body = fast()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), self.header]})
            await send({"type": "http.response.body", "body": body})
        finally:
            self.metrics.finished(path, status, time.monotonic() - t0)

    def _refusal(self, scope) -> Response | None:
        path = scope["path"]
        if path in routes.CONTROL_PATHS:
            if not self.control_routes:
                return error_response(403, f"{path} is disabled on this server (--disable-control-routes)",
                                      "permission_error", code="control_routes_disabled")
            if self.control_key is not None and not self._authorized(scope, self.control_key):
                return error_response(401, f"{path} needs the control API key (send Authorization: Bearer "
                                           "<control key>; see --control-api-key)", "invalid_request_error",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        keyed = self.control_key is not None and path in routes.CONTROL_PATHS
        if not keyed and self.key is not None and (path.startswith("/v1") or path in KEYED_PATHS):
            if not self._authorized(scope, self.key):
                return error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                      "invalid_request_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            keyed = True
        if not keyed:   # a page in a browser cannot send the key cross-site, but can send the rest
            # With a key, what no key guards (/health, /metrics ...) answers anyone, as it always did
            refusal = ((browser.host_refusal(scope, self.allowed_hosts) if self.key is None else None)
                       or browser.origin_refusal(scope, self.allowed_origins))
            if refusal is not None:
                return refusal
        forms = routes.JSON_BODIES.get((routes.label(path), scope["method"]))
        return None if forms is None else browser.content_type_refusal(scope, forms=forms)

    @staticmethod
    def _authorized(scope, keys: tuple[bytes, ...]) -> bool:
        """`Authorization: <scheme> KEY`, the scheme Bearer in any case (RFC 9110; vLLM lower-cases it too).
        Constant time: the key's digest is compared with every key's (no early exit, and equal lengths, so
        neither which key matched nor a key's length shows in the timing)."""
        for k, v in scope["headers"]:
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                digest = hashlib.sha256(token).digest()
                ok = False
                for key in keys:
                    ok |= hmac.compare_digest(digest, key)
                return ok and scheme.lower() == b"bearer"
        return False


def _bearer_digests(keys: str | Sequence[str] | None) -> tuple[bytes, ...] | None:
    """SHA-256 of each key (empty keys dropped); None when none is left."""
    keys = [keys] if isinstance(keys, str) else list(keys or ())
    digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys if k)
    return digests or None


def _has_body(scope) -> bool:
    for k, v in scope["headers"]:
        if (k == b"content-length" and v != b"0") or k == b"transfer-encoding":
            return True
    return False


class DisconnectWatch:
    """Cancels the current task when the client disconnects, or at `stop()` (the server is stopping),
    until `close()`.

    One plain asyncio task: an anyio task group (and Starlette's own, which it runs for a
    stream under ASGI spec < 2.4, Hypercorn's 2.1) cost ~0.1-0.2 ms more per request here,
    on the way to a stream's first bytes."""

    def __init__(self, receive):
        self.task = asyncio.current_task()
        self.cut: str | None = None    # "gone" (the client left) or "stop" (the server stops): cancelled once
        self._closed = False
        self._counted = False          # our cancel's count on the task was taken back
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._cancel("gone")

    def stop(self) -> None:
        self._cancel("stop")

    def _cancel(self, why: str) -> None:
        if not self._closed and self.cut is None:
            self.cut = why
            self.task.cancel()

    def ours(self) -> bool:
        """After a CancelledError: True when it was this watch's alone (the client left, or the stop)."""
        if self.cut is None or self._counted:
            return False
        self._counted = True
        return self.task.uncancel() == 0

    def close(self) -> None:
        self._closed = True
        self._watcher.cancel()
        if self.cut is not None and not self._counted:   # our cancel was swallowed below us: balance its count
            self._counted = True
            self.task.uncancel()


class InFlight:
    """A request in its set until it is answered. At the server's stop (`end_requests`, when the drain ends) one
    whose response has not begun is cancelled (its stages' work with it) and answered SHUTTING_DOWN's 503: else
    Hypercorn's end of the grace cancelled it into a bare 500. Streams that began end by their own watch."""

    def __init__(self, requests: set | None):
        self.task = asyncio.current_task()
        self.started = False     # the response's head went out
        self.cut = False         # stop() cancelled the task; its count is taken back once (ours / close)
        self._requests = requests
        if requests is not None:
            requests.add(self)

    def stop(self) -> bool:
        if self.started or self.cut:
            return False
        self.cut = True
        self.task.cancel()
        return True

    def ours(self) -> bool:
        """After a CancelledError: True when the stop's cancel was the only one and nothing went out yet."""
        if not self.cut:
            return False
        self.cut = False
        return self.task.uncancel() == 0 and not self.started

    def close(self) -> None:
        if self._requests is not None:
            self._requests.discard(self)
        if self.cut:   # swallowed below us: balance its count
            self.cut = False
            self.task.uncancel()


def end_requests(requests: set) -> int:
    """The drain ended: every request not yet answering is answered 503 now; how many were."""
    return sum(f.stop() for f in list(requests))


class ClosingStream(StreamingResponse):
    """Streams until the body ends, the client leaves or stops reading, then closes the body iterator
    (Starlette cancels a stream on disconnect without closing it). A write the client does not take
    within --timeout-response-write ends the response, as nginx's send_timeout: else a stalled reader
    held the request, its stages' work and every output queued for it until it disconnected.
    At the server's stop (`end_streams`) the stream ends with `stopping` (its route's error event: chat's
    STOPPING, speech's speech.audio.error; a callable is asked then); None leaves it without its last chunk,
    so a raw audio client sees the cut (a clean end would pass a truncated WAV off as whole). A stream whose
    closing event (an sse.Last) already went out is ended as it is."""

    _open = False   # the head went out and the body's end did not
    _last = False   # the body's closing event (an sse.Last) was handed to send

    def __init__(self, content, *args, stopping: bytes | Callable[[], bytes] | None = None, **kwargs):
        super().__init__(content, *args, **kwargs)
        self.stopping = stopping

    async def __call__(self, scope, receive, send):
        watch = DisconnectWatch(receive)
        timeout = scope.get(WRITE_TIMEOUT, HttpLimits.timeout_response_write)
        streams = scope.get(OPEN_STREAMS)
        if streams is not None:
            streams.add(watch)
        send = timed_send(send, timeout)
        try:
            try:
                await self._stream(send, watch)
            except asyncio.CancelledError:
                if not watch.ours():
                    raise
            if watch.cut == "stop" and self._open:
                await self._stopped(send)
        except WriteTimeout:
            log.info("%s: the client took no data for %g s (--timeout-response-write); response ended",
                     scope["path"], timeout)
        finally:
            if streams is not None:
                streams.discard(watch)
            watch.close()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
        if self.background is not None:
            await self.background()

    async def _stream(self, send, watch: DisconnectWatch) -> None:
        # A cancel is delivered once and code below us may swallow it; `cut` stops the stream
        # at its next chunk regardless.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._open = True
        async for chunk in self.body_iterator:
            if watch.cut is not None:
                return
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            self._last = isinstance(chunk, sse.Last)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            # A loop turn per chunk: after a reset Hypercorn's send returns at once, and a backlog of queued
            # outputs (taken without awaiting) would go into the dead connection before the watch saw it.
            await asyncio.sleep(0)
        self._open = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stopped(self, send) -> None:
        # The closing event may still sit in the send or the loop turn after it: the stream is whole.
        ending = b"" if self._last else self.stopping() if callable(self.stopping) else self.stopping
        if ending is not None:    # None: returning without the last chunk, Hypercorn cuts the connection
            await send({"type": "http.response.body", "body": ending, "more_body": False})


OPEN_STREAMS = "omni.open_streams"   # scope key: the server's set of open streams' watches
# The server stops under an open stream: chat's SSE ends with this error and [DONE], speech's with its own
# speech.audio.error carrying it.
SHUTTING_DOWN = APIError(503, "server shutting down", type="service_unavailable", code="server_shutting_down")
STOPPING = sse.event(error_body(SHUTTING_DOWN.message, SHUTTING_DOWN.type, code=SHUTTING_DOWN.code)) + sse.DONE


def end_streams(streams: set) -> int:
    """The server stops: every open stream ends now (with its `stopping`); how many were open."""
    open_now = list(streams)
    for watch in open_now:
        watch.stop()
    return len(open_now)


def endpoint(fn: Callable[..., Awaitable[Response]]):
    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except ClientDisconnect:  # gone while its body (JSON or form) was read: nobody to answer
            log.debug("client disconnected from %s before its body ended", request.url.path)
            return Response(status_code=499)
        except Exception as e:  # every failure becomes an OpenAI error body, never a traceback
            return api_error_response(e)
    return wrapper


async def until_disconnect(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Run `work`, cancelling it if the client disconnects first (then a 499 nobody reads)."""
    watch = DisconnectWatch(request.receive)
    try:
        return await work()
    except asyncio.CancelledError:
        if watch.ours():
            log.debug("client disconnected from %s; cancelled", request.url.path)
            return Response(status_code=499)
        raise
    finally:
        watch.close()


class by_method:  # noqa: N801 (used like a function)
    """One ASGI endpoint per path: a method the route table lacks is a 405 whose Allow header names
    every method of the path (one Starlette route per method would name only its own, plus HEAD)."""

    def __init__(self, handlers: dict[str, Callable[[Request], Awaitable[Response]]]):
        self.handlers = handlers
        self.methods = tuple(handlers)
        self.allow = ", ".join(handlers)

    async def __call__(self, scope, receive, send):
        request = Request(scope, receive, send)
        handler = self.handlers.get(request.method)
        if handler is None:
            response = error_response(405, f"{request.method} {request.url.path}: method not allowed; allowed: "
                                           f"{self.allow}", "invalid_request_error", headers={"Allow": self.allow})
        else:
            response = await handler(request)
        await response(scope, receive, send)


async def http_error(request: Request, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_,
                          headers=exc.headers)

