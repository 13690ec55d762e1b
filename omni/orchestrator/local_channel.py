"""LocalStageChannel: the stage channel to a replica on this host, over LocalChannel.

Same behaviour as the ZMQ StageChannel (post never awaits and keeps order, call with a
timeout, `welcomed`, close fails pending calls with Unavailable), read and written on the
event loop's own readiness callbacks: a message that arrives is dispatched in the callback,
with no task switch. The stage's end closing (EOF: the process died or stopped) is reported
through `on_lost`, seconds before the master's lease would say so.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from omni.orchestrator.channel import BaseChannel
from omni.stage.local_link import FramedLink
from omni.transport.base import TransportError

logger = logging.getLogger(__name__)


class LocalStageChannel(BaseChannel):
    kind = "local"

    def __init__(self, link: FramedLink, *, on_lost: Callable[["LocalStageChannel", str], None] | None = None,
                 **kw: Any):
        super().__init__(**kw)
        self._link = link
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._fd = link.fileno()
        self._writing = False
        self._loop.add_reader(self._fd, self._readable)

    def _transmit(self, frame: bytes) -> None:
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
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        self._link.close()
