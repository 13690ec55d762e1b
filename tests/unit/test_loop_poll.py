"""The stage loop's wait (omni/stage/loop_poll.py): its spin before blocking changes when a
message is seen, never what the wait returns or how long an empty wait lasts."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from omni.stage.loop_poll import LoopPoller


@pytest.fixture
def poller(monkeypatch, request):
    monkeypatch.setenv("OMNI_SPIN_US", str(request.param))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    p = LoopPoller(router)
    yield p
    p.close()
    router.close(0)
    ctx.term()


@pytest.mark.parametrize("poller", [0, 50, 10_000], indirect=True)
def test_an_empty_wait_lasts_its_timeout_and_a_ready_fd_or_wake_ends_it(poller):
    assert poller.spin_s * 1e6 in (0, 50, 10_000)
    a, b = socket.socketpair()
    try:
        poller.register(a.fileno())
        t0 = time.monotonic()
        assert poller.poll(60) == (False, False, {})    # the spin counts toward the timeout, and
        assert time.monotonic() - t0 >= 0.055            # an empty spin does not end the wait early
        b.send(b"x")
        router_ready, woke, events = poller.poll(10_000)
        assert not woke and a.fileno() in events
        a.recv(1)
        waker = threading.Thread(target=poller.wake)
        waker.start()
        router_ready, woke, events = poller.poll(10_000)   # another thread's wake-up, during or after the spin
        waker.join()
        assert woke and not events
        assert poller.poll(0) == (False, False, {})
    finally:
        a.close()
        b.close()
