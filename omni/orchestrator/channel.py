"""StageChannel: one frontend's channel to one stage replica.

Two carriers with one behaviour: ZMQ DEALER + CURVE (any host; `StageChannel`) and, for a
replica on this host, LocalChannel (omni/orchestrator/local_channel.py). Each has its own
reader, so a slow stage never holds up another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable

import zmq
import zmq.asyncio

from omni import latency_trace
from omni.errors import BadRequest, Unavailable
from omni.netaddr import endpoint_host, is_ipv6
from omni.stage import messages as m
from omni.stage.curve import MAX_MESSAGE_BYTES, secure_client

logger = logging.getLogger(__name__)

# How long a closed ZMQ channel still tries to deliver what was posted last: the Aborts of the
# requests failed or moved off a replica going SUSPECT, or of every request at shutdown. With
# LINGER 0 they were dropped, and a stage that is still alive kept those streams open.
CLOSE_LINGER_MS = 1000


def _expire(fut: asyncio.Future, method: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"utility call {method!r}: no answer within {timeout:g} s"))


class BaseChannel:
    """What both carriers share: Hello/Welcome, utility calls, dispatch of what arrives."""

    kind = ""

    def __init__(self, *, frontend_id: str, replica_id: str, stage_id: int, endpoint: str, token: str,
                 on_message: Callable[[Any, Any], None], host: str = "127.0.0.1"):
        self.replica_id = replica_id
        self.stage_id = stage_id
        self.endpoint = endpoint
        self._on_message = on_message
        self._codec = m.frontend_codec()
        self._enc = m.Codec(m.FromStage)
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.welcomed = asyncio.get_running_loop().create_future()
        self._hello = m.Hello(frontend_id, token, host)
        self.closed = False

    def start(self) -> None:
        self.post(self._hello)

    def post(self, msg: Any) -> None:
        """Queue `msg` now, in order; the caller never awaits (a full socket keeps it queued)."""
        if self.closed:
            raise Unavailable(f"stage {self.stage_id} replica {self.replica_id}: channel closed")
        frame = self._enc.encode(msg)
        if len(frame) > MAX_MESSAGE_BYTES:
            # Never sent: the stage's ROUTER drops the whole ZMQ connection past the cap (every request
            # on it then waits for its timeout), and the local link refuses it; it fails this request only.
            raise BadRequest(f"stage {self.stage_id} replica {self.replica_id}: a {type(msg).__name__} of "
                             f"{len(frame)} bytes is over the stage channel's {MAX_MESSAGE_BYTES}-byte message cap")
        self._transmit(frame)

    def _transmit(self, frame: bytes) -> None:
        raise NotImplementedError

    async def send(self, msg: Any) -> None:
        self.post(msg)

    async def call(self, method: str, args: dict | None = None, timeout: float = 30.0) -> Any:
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls[call_id] = fut
        # A timer on the future itself: asyncio.wait_for wraps it in a second future and a callback.
        timer = loop.call_later(timeout, _expire, fut, method, timeout)
        try:
            self.post(m.Utility(call_id, method, args or {}))
            res: m.UtilityResult = await fut
        finally:
            timer.cancel()
            self._calls.pop(call_id, None)
        if not res.ok:
            raise RuntimeError(res.error)
        return res.result

    def adopt(self, other: "BaseChannel", frames: list[bytes]) -> None:
        """Take over a channel to the same replica that never got going (a failed local connect):
        its pending calls and Welcome, then send its frames (its Hello first) in order."""
        self._calls, self._ids, self.welcomed = other._calls, other._ids, other.welcomed
        for frame in frames:
            self._transmit(frame)

    def _dispatch(self, payload) -> None:
        try:
            msg = self._codec.decode(payload)
        except Exception as e:
            logger.warning("undecodable message from %s: %s", self.replica_id, e)
            return
        if isinstance(msg, m.UtilityResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.Welcome):
            if not self.welcomed.done():
                self.welcomed.set_result(msg)
        else:
            if latency_trace.on() and isinstance(msg, m.Output):
                latency_trace.mark("recv", msg.request_id, len(msg.token_ids))
            self._on_message(self, msg)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(Unavailable(f"replica {self.replica_id} went away"))
        self._close_carrier()

    def _close_carrier(self) -> None:
        raise NotImplementedError


class StageChannel(BaseChannel):
    """ZMQ DEALER with CURVE (the token's keys) to the replica's ROUTER."""

    kind = "zmq"

    def __init__(self, ctx: zmq.asyncio.Context, **kw: Any):
        super().__init__(**kw)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, kw["frontend_id"].encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        if is_ipv6(endpoint_host(self.endpoint)):
            self._sock.setsockopt(zmq.IPV6, 1)   # libzmq dials an IPv6 address only with it on
        secure_client(self._sock, kw["token"])
        self._sock.connect(self.endpoint)
        self._reader = asyncio.create_task(self._read(), name=f"omni-channel-{self.replica_id}")

    def _transmit(self, frame: bytes) -> None:
        # pyzmq sends at once when it can and keeps later sends behind earlier ones when full.
        fut = self._sock.send(frame)
        if not fut.done():
            fut.add_done_callback(self._sent)
        elif fut.exception() is not None:
            self._sent(fut)

    def _sent(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None and not self.closed:
            logger.warning("send to %s failed: %s", self.replica_id, fut.exception())

    async def _read(self) -> None:
        while True:
            try:
                frame = await self._sock.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self._dispatch(frame.buffer)

    def _close_carrier(self) -> None:
        self._reader.cancel()
        self._sock.close(CLOSE_LINGER_MS)    # in libzmq's own thread: the loop does not wait (ctx.term() does)
