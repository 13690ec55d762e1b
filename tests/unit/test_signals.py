"""Signals only note a stop request (no locks in the handler), so a storm of SIGTERM/SIGINT
cannot deadlock a stage: its loop notices and stops. A threading.Event or a lock taken in the
handler could (the handler runs on the main thread, perhaps inside that very lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from omni.signals import StopRequest
from tests.e2e.harness import REPO


def test_stop_request_from_a_handler_wakes_a_waiter():
    stop = StopRequest()
    assert not stop.wait(0) and not stop.is_set()
    old = signal.signal(signal.SIGUSR1, stop.set)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(5) and stop.is_set()
        for _ in range(100_000):   # far more than the pipe holds: set() never blocks
            stop.set()
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_storm_of_signals_stops_a_busy_stage_worker():
    child = subprocess.Popen([sys.executable, "-m", "tests.unit.signal_child"], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for i in range(500):
            child.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
        assert child.wait(30) == 0
        assert child.stdout.read().strip() == "stopped"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
