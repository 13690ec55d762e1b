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


# The main thread blocks in StopRequest.wait(); another thread takes the SIGTERM (as a grpc
# thread may). The kicker fires once the main thread sleeps in select() inside wait(): a signal
# before that runs the handler on the main thread's next bytecode and proves nothing.
_OTHER_THREAD_CHILD = """
import signal, sys, threading, time
from omni.signals import StopRequest
stop = StopRequest().install()
main, tid = threading.main_thread().ident, threading.get_native_id()
def in_select():
    with open(f"/proc/self/task/{tid}/wchan") as f:
        wchan = f.read()
    return sys._current_frames()[main].f_code.co_name == "wait" and ("poll" in wchan or "select" in wchan)
def kick():
    deadline = time.monotonic() + 20
    while not in_select() and time.monotonic() < deadline:
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
threading.Thread(target=kick).start()
stop.wait()
print("stopped", flush=True)
"""


def test_a_sigterm_taken_by_another_thread_still_ends_a_wait_for_good():
    child = subprocess.Popen([sys.executable, "-c", _OTHER_THREAD_CHILD], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.wait(30) == 0   # hung for good before the waits were sliced
        assert child.stdout.read().strip() == "stopped"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
