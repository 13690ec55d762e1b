"""The CLI's calls to the master run off the main thread while it waits for them or for Ctrl-C:
a SIGINT raised as KeyboardInterrupt inside grpc's code can leave the channel so that closing it
hangs (grpc issue 19973)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from omni.master.commands import Interrupted, ctrl_c, in_thread


def test_ctrl_c_ends_the_wait_with_no_keyboard_interrupt_and_the_handler_is_put_back():
    before = signal.getsignal(signal.SIGINT)
    release = threading.Event()
    inside: list[str] = []

    def call():                       # a grpc call waiting for its answer
        inside.append(threading.current_thread().name)
        release.wait(10)
        return "late"
    try:
        with ctrl_c() as stop:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(Interrupted):
                in_thread(call, stop)
            assert stop.is_set() and inside == ["omni-master-call"]
    finally:
        release.set()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_calls_result_and_error_come_back_to_the_caller():
    with ctrl_c() as stop:
        assert in_thread(lambda: 42, stop) == 42
        with pytest.raises(ValueError, match="bad"):
            in_thread(lambda: (_ for _ in ()).throw(ValueError("bad")), stop)


def test_off_the_main_thread_no_handler_is_set():
    out = {}

    def run():
        with ctrl_c() as stop:
            out["value"] = in_thread(lambda: "ok", stop)
    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert out == {"value": "ok"}
