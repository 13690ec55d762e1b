"""LocalStageChannel: the stage channel to a replica on this host, over LocalChannel.

Same behaviour as the ZMQ StageChannel (post never awaits and keeps order, call with a
timeout, `welcomed`, close fails pending calls with Unavailable), read and written on the
event loop's own readiness callbacks: a message that arrives is dispatched in the callback,
with no task switch. The stage's end closing (EOF: the process died or stopped) is reported
through `on_lost`, seconds before the master's lease would say so. The connect itself
(`LocalStageChannel.connect`) runs on the loop too, so a stage that does not answer it holds
up nothing; the channel falls back to ZMQ then.

After it posts or reads, the channel keeps the loop polling (its readiness check with no wait)
for OMNI_SPIN_US, by one callback that re-queues itself: a reply landing meanwhile is read
without the wake-up of a halted vCPU, ~30 us on this VM (docs/transport-benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from omni import envs
from omni.orchestrator.channel import BaseChannel
from omni.stage.local_link import FramedLink, connect_stage_async
from omni.transport.base import TransportError

logger = logging.getLogger(__name__)

# A same-host stage answers the hello in well under a millisecond; one that does not within
# this (alive but stopped, or swamped) is reached over ZMQ instead.
CONNECT_TIMEOUT_S = 1.0


class LoopSpin:
    """Keeps `loop` polling without waiting until `spin_s` after the last `extend()`: a queued
    callback makes asyncio and uvloop poll their fds with a zero timeout on each turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float):
        self._loop = loop
        self._spin_s = spin_s
        self._until = 0.0
        self._queued = False

    def extend(self) -> None:
        if self._spin_s <= 0:
            return
        self._until = time.perf_counter() + self._spin_s
        if not self._queued:
            self._queued = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        if time.perf_counter() < self._until:
            self._loop.call_soon(self._turn)
        else:
            self._queued = False


class LocalStageChannel(BaseChannel):
    kind = "local"

    def __init__(self, link: FramedLink | None, *, on_lost: Callable[["LocalStageChannel", str], None] | None = None,
                 **kw: Any):
        super().__init__(**kw)
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._writing = False
        self._link: FramedLink | None = None
        self._fd = -1
        self._backlog: list[bytes] | None = None    # frames posted while connecting
        self._connecting: asyncio.Task | None = None
        self._spin = LoopSpin(self._loop, envs.OMNI_SPIN_US / 1e6)
        if link is not None:
            self._attach(link)

    @classmethod
    def connect(cls, fallback: Callable[[], BaseChannel | None],
                on_fallback: Callable[["LocalStageChannel", BaseChannel], None], timeout: float = CONNECT_TIMEOUT_S,
                **kw: Any) -> "LocalStageChannel":
        """A channel that connects without blocking the loop: what is posted meanwhile waits, in
        order, and goes over the link once it is up. If it cannot be (another host's name, a
        refusal, no hello within `timeout`: a stopped stage), `fallback()` makes the ZMQ channel,
        which takes over the waiting frames and pending calls, and `on_fallback(self, it)` tells
        the owner to use it instead; with no fallback the channel is lost (`on_lost`)."""
        ch = cls(None, **kw)
        ch._backlog = []
        ch._connecting = ch._loop.create_task(ch._connect(kw["token"], timeout, fallback, on_fallback),
                                              name=f"omni-local-connect-{ch.replica_id}")
        return ch

    async def _connect(self, token: str, timeout: float, fallback: Callable[[], BaseChannel | None],
                       on_fallback: Callable[["LocalStageChannel", BaseChannel], None]) -> None:
        link = await connect_stage_async(self.endpoint, token, timeout)
        self._connecting = None
        if self.closed:
            if link is not None:
                link.close()
            return
        frames, self._backlog = self._backlog or [], None
        if link is not None:
            self._attach(link)
            for frame in frames:
                self._transmit(frame)
            return
        try:
            other = fallback()
        except Exception as e:
            self._lost(f"no local connection, and ZMQ failed: {type(e).__name__}: {e}")
            return
        if other is None:
            self._lost("no local connection and no ZMQ endpoint")
            return
        other.adopt(self, frames)
        self._calls = {}        # they are the other channel's now
        self.close()
        on_fallback(self, other)

    def _attach(self, link: FramedLink) -> None:
        self._link = link
        self._fd = link.fileno()
        self._loop.add_reader(self._fd, self._readable)

    def _transmit(self, frame: bytes) -> None:
        if self._backlog is not None:
            self._backlog.append(frame)
            return
        try:
            self._link.send(frame)      # no queue limit on this side: queued packets wait for writable
        except TransportError as e:
            # As a ZMQ send to a dead replica, the message is lost; unlike it, the loss is reported
            # (after the caller's step), so the request is replayed or failed now, not at lease expiry.
            self._loop.call_soon(self._lost, str(e))
            return
        if self._link.pending and not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)
        self._spin.extend()     # an answer often follows within microseconds

    def _writable(self) -> None:
        try:
            done = self._link.flush()
        except TransportError as e:
            self._lost(str(e))
            return
        if done:
            self._writing = False
            self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        try:
            msgs, eof = self._link.read()
        except TransportError as e:
            msgs, eof = [], True
            logger.warning("stage channel to %s: %s", self.replica_id, e)
        self._spin.extend()
        for payload in msgs:
            if self.closed:
                return
            self._dispatch(payload)
        if eof:
            self._lost("the replica closed its channel")

    def _lost(self, why: str) -> None:
        if self.closed:     # closed on purpose (topology said gone, shutdown): nothing to report
            return
        logger.info("stage %d replica %s: local channel lost: %s", self.stage_id, self.replica_id, why)
        self.close()
        if self._on_lost is not None:
            self._on_lost(self, why)

    def _close_carrier(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        self._backlog = None
        if self._link is None:
            return
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        self._link.close()
