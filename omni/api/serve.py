"""Run an ASGI app on Hypercorn, on a socket we bind (or were handed) so the real port is known."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from omni.api import http1
from omni.api.http import end_requests, end_streams
from omni.api.limits import HttpLimits

log = logging.getLogger(__name__)


def bind_socket(host: str = "127.0.0.1", port: int = 0, *, backlog: int = HttpLimits.backlog) -> socket.socket:
    """A listening TCP socket. Never SO_REUSEPORT: a port in use is refused, and no other
    process can bind beside us and take a share of the connections. Several frontends
    share one listener by inheriting its fd."""
    host = host.strip("[]")   # --host [::1], as a URL writes it
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # only skips TIME_WAIT on Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(app, *, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None,
                shutdown_event: asyncio.Event,
                on_ready: Callable[[str, int], None] | None = None, access_log: bool = False,
                graceful_timeout: float = 5.0, limits: HttpLimits | None = None) -> None:
    """Serve `app` until `shutdown_event` is set, then stop within `graceful_timeout`.

    `sock` (already bound, e.g. inherited from a parent) wins over host/port; it is closed at the stop.
    `on_ready(host, port)` is called with the real bound address once the socket is ready (port 0 -> the
    kernel's pick). The app's open streams (`app.state.streams`, build_app's) run on for the grace less a
    second, then end cleanly (http.end_streams): Hypercorn's own end of the grace cancels them mid-body.
    Requests not yet answering then (`app.state.in_flight`) are answered 503 server_shutting_down (http.end_requests).
    `limits.shutdown_timeout` N (vLLM's --shutdown-timeout) replaces the grace: streams end N s after the
    stop (0: at once), and Hypercorn waits a second more for their closing events.
    """
    limits = limits or HttpLimits()
    streams_after, graceful_timeout = drain_times(limits.shutdown_timeout, graceful_timeout)
    owned = sock is None
    if sock is None:
        sock = bind_socket(host, port, backlog=limits.backlog)
    bound_host, bound_port = sock.getsockname()[:2]
    config = Config()
    # Hypercorn takes ownership of the fd it is given and closes it: give it a duplicate.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = logging.getLogger("omni.api.access") if access_log else None
    config.errorlog = logging.getLogger("omni.api.hypercorn")
    config.graceful_timeout = graceful_timeout
    # Hypercorn's idle timer runs from accept (and from each response) until a request's head is
    # complete: it is the header timeout as well as the keep-alive one. Not read_timeout: that
    # would cut SSE streams whose client sends nothing. Bodies are timed by LimitsMiddleware.
    config.keep_alive_timeout = limits.timeout_keep_alive
    http1.install()   # HTTP/2 would escape that timer: see omni/api/http1.py
    config.include_server_header = False
    config.backlog = limits.backlog   # asyncio listen()s again on the socket it is given
    log.info("HTTP frontend listening on %s:%d", bound_host, bound_port)
    if on_ready is not None:
        on_ready(bound_host, bound_port)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(_quiet_cancel(shutdown_event, previous))
    state = getattr(app, "state", None)
    streams, in_flight = getattr(state, "streams", None), getattr(state, "in_flight", None)
    ender = None if streams is None and in_flight is None else asyncio.create_task(
        _end_streams(shutdown_event, set() if streams is None else streams,
                     set() if in_flight is None else in_flight, streams_after))
    closer = asyncio.create_task(_close_at_stop(shutdown_event, sock))
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_event.wait)
    finally:
        closer.cancel()
        if ender is not None:
            ender.cancel()
        loop.set_exception_handler(previous)
        if owned:
            sock.close()


def drain_times(shutdown_timeout: int | None, graceful_timeout: float) -> tuple[float, float]:
    """(seconds open streams run on after a stop, Hypercorn's grace) for --shutdown-timeout (None: not given)."""
    if shutdown_timeout is None:
        return max(0.0, graceful_timeout - 1.0), graceful_timeout
    return float(shutdown_timeout), shutdown_timeout + 1.0


async def _close_at_stop(stopping: asyncio.Event, sock: socket.socket) -> None:
    """Hypercorn closes its copy of the listener at the stop; ours (and the launcher's, omni/launcher.py) too,
    so a connection made during the drain is refused rather than queued unanswered until the last one closes."""
    await stopping.wait()
    sock.close()


async def _end_streams(stopping: asyncio.Event, streams: set, in_flight: set, after_s: float) -> None:
    await stopping.wait()
    await asyncio.sleep(after_s)   # the grace: requests that end by themselves by then end whole
    n = end_streams(streams)
    if n:
        log.info("stopping: ended %d open stream(s) (SSE: a 'server shutting down' error event and [DONE])", n)
    n = end_requests(in_flight)
    if n:
        log.info("stopping: answered %d unanswered request(s) 503 server_shutting_down", n)


def _quiet_cancel(stopping: asyncio.Event, previous):
    """A stop with streams open cancels their connections' tasks; asyncio's stream protocol (Python 3.11)
    then logged each CancelledError with a traceback at ERROR. During a stop that is one INFO line."""
    def handle(loop, context):
        if stopping.is_set() and isinstance(context.get("exception"), asyncio.CancelledError):
            log.info("stopping: a connection's task was cancelled (%s)", context.get("message", "")[:120])
            return
        (previous or (lambda lp, ctx: lp.default_exception_handler(ctx)))(loop, context)
    return handle
