"""StageChannel: one frontend's DEALER socket to one stage replica.

Each channel has its own reader task, so a slow stage never holds up another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable

import zmq
import zmq.asyncio

from omni import latency_trace
from omni.errors import Unavailable
from omni.stage import messages as m
from omni.stage.curve import secure_client

logger = logging.getLogger(__name__)


class StageChannel:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        frontend_id: str,
        replica_id: str,
        stage_id: int,
        endpoint: str,
        token: str,
        on_message: Callable[["StageChannel", Any], None],
        host: str = "127.0.0.1",
    ):
        self.replica_id = replica_id
        self.stage_id = stage_id
        self.endpoint = endpoint
        self._on_message = on_message
        self._codec = m.frontend_codec()
        self._enc = m.Codec(m.FromStage)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, frontend_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_client(self._sock, token)
        self._sock.connect(endpoint)
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.welcomed = asyncio.get_running_loop().create_future()
        self._hello = m.Hello(frontend_id, token, host)
        self._reader = asyncio.create_task(self._read(), name=f"omni-channel-{replica_id}")
        self.closed = False

    def start(self) -> None:
        self.post(self._hello)

    def post(self, msg: Any) -> None:
        """Queue `msg` now, in order: pyzmq sends at once when it can and keeps later sends
        behind earlier ones when the socket is full, so the caller never awaits."""
        if self.closed:
            raise Unavailable(f"stage {self.stage_id} replica {self.replica_id}: channel closed")
        fut = self._sock.send(self._enc.encode(msg))
        if not fut.done():
            fut.add_done_callback(self._sent)
        elif fut.exception() is not None:
            self._sent(fut)

    def _sent(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None and not self.closed:
            logger.warning("send to %s failed: %s", self.replica_id, fut.exception())

    async def send(self, msg: Any) -> None:
        self.post(msg)

    async def call(self, method: str, args: dict | None = None, timeout: float = 30.0) -> Any:
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self.send(m.Utility(call_id, method, args or {}))
            res: m.UtilityResult = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not res.ok:
            raise RuntimeError(res.error)
        return res.result

    async def _read(self) -> None:
        while True:
            try:
                frame = await self._sock.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                msg = self._codec.decode(frame.buffer)
            except Exception as e:
                logger.warning("undecodable message from %s: %s", self.replica_id, e)
                continue
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
        self._reader.cancel()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(Unavailable(f"replica {self.replica_id} went away"))
        self._sock.close(0)
