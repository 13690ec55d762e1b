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


def test_watch_redraws_on_a_change_of_shape_at_once_and_on_load_alone_at_most_each_interval(monkeypatch):
    """`omni status --watch` drew a view for each load-only event (the master sends one per replica each load
    interval; a stage's CPU seconds always move): 3-4 a second on an idle deployment."""
    import time

    from omni.master import commands
    from omni.master.types import ReplicaInfo, StageStatus, Status

    monkeypatch.setattr(commands, "LOAD_REDRAW_S", 0.3)

    def status(age=0.1, cpu=1.0, sleeping=False, queue_len=0):
        rep = ReplicaInfo(stage_id=0, replica_id="s0r0", replica_index=0, role="STAGE", host="h", pid=7, endpoints={},
                          state="READY", queue_len=queue_len, in_flight=0, requests_total=0, cpu_seconds=cpu,
                          is_sleeping=sleeping, draining=False, extra={}, heartbeat_age_s=age, version="",
                          capabilities={})
        return Status([rep], [StageStatus(0, 1, 1)], "h", True, 5.0, {})

    views = [status()]                                                    # the SNAPSHOT: drawn
    views += [status(age=0.1 + i / 100, cpu=1.0 + i) for i in range(20)]  # load events, nothing shown moves
    views += [status(sleeping=True), status(sleeping=True, queue_len=7)]  # drawn at once; then within 0.3 s

    class FakeClient:
        now, fetched = views[0], threading.Event()

        def watch(self):
            client = self

            class Watch:
                def __iter__(self):
                    for v in views:   # the next event once this one's status was read: none coalesce
                        client.fetched.clear()
                        client.now = v
                        yield "event"
                        assert client.fetched.wait(5)
                    time.sleep(1.0)                  # the watch stays open: the held load change is drawn

                def cancel(self):
                    pass
            return Watch()

        def get_status(self):
            self.fetched.set()
            return self.now

    drawn: list[tuple[float, Status]] = []
    monkeypatch.setattr(commands, "_show", lambda st, json_, clear: drawn.append((time.monotonic(), st)))
    with ctrl_c() as stop:
        last = commands._watch(FakeClient(), True, stop)
    shown = [(st.replicas[0].is_sleeping, st.replicas[0].queue_len) for _, st in drawn]
    assert shown == [(False, 0), (True, 0), (True, 7)], shown
    assert drawn[2][0] - drawn[1][0] >= 0.3 * 0.9          # the load change waited for the interval
    assert last is drawn[-1][1]
