"""The stage channel on one host: stage messages over LocalChannel (omni/transport/local.py).

A frontend and a stage replica of one user on one host talk over an abstract unix SEQPACKET
socket instead of ZMQ+CURVE: one syscall per message each way and no libzmq I/O threads
(benchmarks/stage_channel.py measures both). The listener admits only this user and the
token hello, so it is as strict as CURVE; ZMQ stays for other hosts.

A packet holds at most 64 KiB, a stage message up to curve.MAX_MESSAGE_BYTES, 64 MiB (the
largest real one: an AddRequest with inline audio, up to 900 s a request of 16 kHz float32 = 57.6 MB; a long
prompt is ~3 bytes a token), so a message goes as pieces, each led by one byte: 0 the last piece,
1 more follow. Outputs, refs, frees and utility calls fit one packet. Sends never block:
packets the socket cannot take yet wait in the link's queue (`pending`) until it is writable.
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections import deque
from typing import Any, Callable

from omni import envs
from omni.errors import OmniError
from omni.stage.loop_poll import GONE, IN, OUT, LoopPoller
from omni.stage.curve import MAX_MESSAGE_BYTES
from omni.transport.base import TransportError
from omni.transport.local import MAX_MESSAGE_BYTES as MAX_PACKET
from omni.transport.local import LocalChannel, LocalListener, connect_local, connect_local_async

logger = logging.getLogger(__name__)

LAST, MORE = b"\x00", b"\x01"
PIECE = MAX_PACKET - 1
SCHEME = "local://"
# Packets a stage queues for one frontend before it holds output (as ZMQ's send high-water mark).
STAGE_QUEUE_PACKETS = 1000
CLOSED = "it closed its channel"    # a frontend that stopped or restarted: not a warning


def local_enabled() -> bool:
    """OMNI_STAGE_CHANNEL: "local" (same-host pairs use LocalChannel) or "zmq" (never)."""
    mode = envs.OMNI_STAGE_CHANNEL
    if mode not in ("local", "zmq"):
        raise OmniError(f"OMNI_STAGE_CHANNEL={mode!r}: expected 'local' or 'zmq'")
    return mode == "local"


def local_endpoint(name: str) -> str:
    """What a stage publishes beside its ZMQ endpoint: its host name and the abstract name."""
    return f"{SCHEME}{socket.gethostname()}/{name}"


def same_host_name(endpoint: str) -> str | None:
    """The abstract name in `endpoint` if it was published on this host, else None."""
    if not endpoint.startswith(SCHEME):
        return None
    host, _, name = endpoint[len(SCHEME):].partition("/")
    return name if name and host == socket.gethostname() else None


class FramedLink:
    """Whole stage messages over one LocalChannel, in order, without blocking."""

    def __init__(self, ch: LocalChannel, max_queued: int | None = None, max_bytes: int = MAX_MESSAGE_BYTES):
        self.ch = ch
        self.max_queued = max_queued
        self.max_bytes = max_bytes
        self._out: deque[bytes] = deque()
        self._parts: list[bytes] = []
        self._size = 0

    def fileno(self) -> int:
        return self.ch.fileno()

    @property
    def pending(self) -> bool:
        """Packets wait for the socket to take them (watch for writable, then `flush`)."""
        return bool(self._out)

    def send(self, frame: bytes) -> bool:
        """Send or queue one message. False (nothing kept) when `max_queued` packets already
        wait; ValueError past the size cap; TransportError once the peer is gone."""
        n = len(frame)
        if n > self.max_bytes:
            raise ValueError(f"stage message of {n} bytes exceeds the channel's cap of {self.max_bytes}")
        if self._out:
            if self.max_queued is not None and len(self._out) >= self.max_queued:
                return False
            self._queue(frame)
            self.flush()
            return True
        if n <= PIECE:
            if not self.ch.send(LAST + frame, wait=False):
                self._out.append(LAST + frame)
            return True
        self._queue(frame)
        self.flush()
        return True

    def _queue(self, frame: bytes) -> None:
        view = memoryview(frame)
        for i in range(0, max(len(frame), 1), PIECE):
            self._out.append((MORE if i + PIECE < len(frame) else LAST) + view[i:i + PIECE])

    def flush(self) -> bool:
        """Send what the socket takes now; True when nothing waits any more."""
        out = self._out
        while out:
            if not self.ch.send(out[0], wait=False):
                return False
            out.popleft()
        return True

    def read(self, limit: int = 256) -> tuple[list[bytes | memoryview], bool]:
        """The messages waiting now (at most `limit`: a peer that keeps sending cannot hold the
        caller's loop; the rest keeps the fd readable), and whether the peer closed the channel."""
        msgs: list[bytes | memoryview] = []
        ch = self.ch
        while len(msgs) < limit:
            try:
                pkt = ch.recv_nowait()
            except ConnectionError:
                return msgs, True
            if pkt is None:
                return msgs, False
            head = pkt[:1]
            if head == LAST and not self._parts:
                msgs.append(memoryview(pkt)[1:])
                if not ch.waiting():    # a close shows as readable again: the next read sees it
                    return msgs, False
                continue
            if head not in (LAST, MORE):
                raise TransportError(f"stage channel: bad packet header {head!r}")
            self._size += len(pkt) - 1
            if self._size > self.max_bytes:
                raise TransportError(f"stage channel: a message over {self.max_bytes} bytes")
            self._parts.append(pkt[1:])
            if head == LAST:
                msgs.append(b"".join(self._parts))
                self._parts, self._size = [], 0
            if not ch.waiting():
                return msgs, False
        return msgs, False

    def close(self) -> None:
        self.ch.close()


def connect_stage(endpoint: str, token: str, timeout: float = 1.0) -> FramedLink | None:
    """A link to the stage at `endpoint` when it is on this host and admits us, else None.
    Blocking: a connect and one hello round trip with the stage's accept thread; `timeout`
    bounds it for a stage that does not answer. (Frontends use connect_stage_async.)"""
    name = same_host_name(endpoint)
    if name is None:
        return None
    try:
        return FramedLink(connect_local(name, token or None, timeout=timeout))
    except (TransportError, OSError) as e:
        logger.info("stage channel %s: no local connection (%s); using ZMQ", endpoint, e)
        return None


async def connect_stage_async(endpoint: str, token: str, timeout: float = 1.0) -> FramedLink | None:
    """connect_stage on the event loop, without blocking it (the frontend's connect)."""
    name = same_host_name(endpoint)
    if name is None:
        return None
    try:
        return FramedLink(await connect_local_async(name, token or None, timeout=timeout))
    except (TransportError, OSError) as e:
        logger.info("stage channel %s: no local connection (%s); using ZMQ", endpoint, e)
        return None


class LocalPeers:
    """A stage's same-host frontends: the listener and one link per connected frontend, their
    fds in the worker's poller. A frontend is known by an ident that no ZMQ peer can have (ZMQ
    reserves a leading zero byte), so the worker keeps one table of frontends for both kinds."""

    def __init__(self, token: str, on_accept: Callable[[], None]):
        self.listener = LocalListener(token or None, on_accept=on_accept)
        self.endpoint = local_endpoint(self.listener.name)
        self._links: dict[bytes, FramedLink] = {}
        self._by_fd: dict[int, bytes] = {}
        self._writing: set[int] = set()     # fds the poller watches for writable
        self._queued: set[int] = set()      # fds whose link queued packets since the last watch_writable
        self._ids = itertools.count(1)
        self._poller: LoopPoller | None = None

    def attach(self, poller: LoopPoller) -> None:
        self._poller = poller
        for fd in self._by_fd:
            poller.register(fd, IN)

    def accept(self) -> None:
        """Take the connections accepted since the last call (the listener woke the loop)."""
        while (ch := self.listener.accept_nowait()) is not None:
            ident = b"\0local-%d" % next(self._ids)
            self._links[ident] = FramedLink(ch, max_queued=STAGE_QUEUE_PACKETS)
            self._by_fd[ch.fileno()] = ident
            if self._poller is not None:
                self._poller.register(ch.fileno(), IN)

    def link(self, ident: bytes) -> FramedLink | None:
        return self._links.get(ident) if self._links else None

    @property
    def connected(self) -> bool:
        """A same-host frontend is connected (its answers come fast enough to spin for)."""
        return bool(self._links)

    def send(self, link: FramedLink, frame: bytes) -> bool:
        """`link.send`, noting a link that now queues packets for `watch_writable`."""
        ok = link.send(frame)
        if link.pending:
            self._queued.add(link.fileno())
        return ok

    def service(self, events: dict, receive: Callable[[bytes, Any], None],
                gone: Callable[[bytes, str], None]) -> None:
        """Read the frontends that have messages (`receive(ident, payload)`), push queued output
        to those that take it again, and report those that closed their channel (`gone`)."""
        for fd, ev in list(events.items()):
            ident = self._by_fd.get(fd) if isinstance(fd, int) else None
            if ident is None:
                continue
            link = self._links[ident]
            try:
                if ev & OUT:
                    link.flush()
                if not ev & (IN | GONE):
                    continue
                msgs, eof = link.read()
                for payload in msgs:
                    receive(ident, payload)
                if not eof:
                    continue
                why = CLOSED
            except TransportError as e:
                why = str(e)
            if ident in self._links:
                gone(ident, why)

    def watch_writable(self) -> None:
        """Watch for writable exactly the links whose packets wait. Only links that queued
        since the last call or are watched can change, so the usual call tests two empty sets."""
        if not self._queued and not self._writing:
            return
        check, self._queued = self._queued | self._writing, set()
        want = {fd for fd in check if fd in self._by_fd and self._links[self._by_fd[fd]].pending}
        if want == self._writing or self._poller is None:
            return
        for fd in want - self._writing:
            self._poller.modify(fd, IN | OUT)
        for fd in self._writing - want:
            self._poller.modify(fd, IN)
        self._writing = want

    def drop(self, ident: bytes) -> None:
        """Forget a frontend and close its channel."""
        link = self._links.pop(ident, None)
        if link is None:
            return
        fd = link.fileno()
        self._by_fd.pop(fd, None)
        self._writing.discard(fd)
        self._queued.discard(fd)
        if self._poller is not None:
            self._poller.unregister(fd)
        link.close()

    def close(self) -> None:
        self.listener.close()
        for ident in list(self._links):
            self.drop(ident)
