"""The stage worker loop's wait: one epoll over raw fds, its ROUTER socket and a wake-up socket.

zmq.Poller goes through zmq_poll, which for each call polls twice (a first pass with no wait)
and asks every ZMQ socket for its EVENTS before and after: about 3 us of CPU a wake-up, on
every message of a same-host frontend too (measured, docs/transport-benchmarks.md). Here
the local links, the engine's ready fd and the stop pipe are plain epoll entries, and the
ROUTER is asked for its EVENTS only when it can have changed: its FD (an edge-style
"look at me" signal, not "readable") fired, or the loop used the socket since the last wait
(`touched`), since a send or receive may take in the notice of a new message itself.
The wake-up is a socketpair, not a ZMQ pair, so other threads wake the loop with one send.

Before a wait that would block, the loop polls without blocking for up to OMNI_SPIN_US (50 us by
default): on a VM whose idle vCPUs halt, waking a blocked process from the other vCPU costs
about 30 us each way, while a message that lands during the spin is seen within a microsecond
(docs/transport-benchmarks.md, "Wake-ups"). The spin is bounded per wait, so an idle stage
spends at most that much CPU per wait (one a second when nothing is in flight). The worker
spins only while a same-host frontend is connected: a ZMQ round trip from another host takes
longer than the spin, which would only burn CPU.
"""

from __future__ import annotations

import select
import socket
import time

import zmq

from omni import envs
from omni.transport.util import spin_until

IN = select.EPOLLIN
OUT = select.EPOLLOUT
GONE = select.EPOLLERR | select.EPOLLHUP   # reported whether asked for or not


class LoopPoller:
    def __init__(self, router: zmq.Socket):
        self._router = router
        self._zfd = router.getsockopt(zmq.FD)
        self._ep = select.epoll()
        self._ep.register(self._zfd, IN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wfd = self._wake_r.fileno()
        self._ep.register(self._wfd, IN)
        self.touched = True     # the loop used the ROUTER: ask it for EVENTS before waiting
        self.spin_s = envs.OMNI_SPIN_US / 1e6

    def wake(self) -> None:
        """From any thread: the loop's next (or current) wait returns with `woke`."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass    # its buffer is full (it is readable already) or the poller is closed

    def register(self, fd: int, mask: int = IN) -> None:
        self._ep.register(fd, mask)

    def modify(self, fd: int, mask: int) -> None:
        self._ep.modify(fd, mask)

    def unregister(self, fd: int) -> None:
        self._ep.unregister(fd)

    def poll(self, timeout_ms: int, spin: bool = True) -> tuple[bool, bool, dict[int, int]]:
        """Wait up to `timeout_ms`: (the ROUTER has messages, a wake-up came, {fd: events} of the rest).
        `spin=False`: block at once (no same-host peer whose answer could land within the spin)."""
        router_ready = False
        if self.touched:
            self.touched = False
            if self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                router_ready, timeout_ms = True, 0
        woke = False
        events: dict[int, int] = {}
        for fd, ev in self._wait(timeout_ms / 1000, spin):
            if fd == self._zfd:
                router_ready = router_ready or bool(self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            elif fd == self._wfd:
                woke = True
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            else:
                events[fd] = ev
        if router_ready:
            self.touched = True     # the caller reads it
        return router_ready, woke, events

    def _wait(self, timeout_s: float, spin: bool) -> list[tuple[int, int]]:
        if timeout_s <= 0 or self.spin_s <= 0 or not spin:
            return self._ep.poll(timeout_s)
        start = time.perf_counter()
        ready = spin_until(lambda: self._ep.poll(0), min(self.spin_s, timeout_s))
        return ready or self._ep.poll(max(0.0, timeout_s - (time.perf_counter() - start)))

    def close(self) -> None:
        self._ep.close()
        self._wake_r.close()
        self._wake_w.close()
