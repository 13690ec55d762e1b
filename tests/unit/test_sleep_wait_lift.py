"""A lift reaches a frontend while its QUIESCE wait runs. A replica's keep-alive thread ran its commands one
after another, and a frontend's wait blocked it: Ctrl-C on `omni sleep --mode wait` sent the lift, which sat
behind the wait, so every frontend went on refusing new requests (503 "going to sleep") until the requests in
flight ended, the CLI's lift timed out after 5 s, and `omni wakeup` said "awake" meanwhile (found by a soak)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from omni._proto import master_pb2 as pb
from omni.errors import Unavailable
from omni.master import wire
from omni.master.client import MasterClient
from omni.orchestrator import quiesce
from tests.unit.master_peers import keep_alive, wait_until
from tests.unit.test_master_bad_input import HASH, master  # noqa: F401

CALLED_OFF = "called off: the hold was lifted (or the frontend stopped) before the requests ended"


def test_a_lift_ends_the_wait_it_calls_off_at_once():
    gate = quiesce.Gate()
    waiting = gate.on_command({"hold_s": 30.0, "wait_s": 20.0, "token": "t"}, lambda: 1)
    assert isinstance(waiting, Future) and not waiting.done()
    with pytest.raises(Unavailable):
        gate.check()                                   # held from the command on, not from the thread's start
    assert gate.on_command({"hold_s": 0.0, "token": "t"}, lambda: 1) == (True, "admitting requests")
    gate.check()                                       # admitting again
    assert waiting.result(timeout=5) == (False, CALLED_OFF)


def test_another_sleeps_lift_leaves_the_wait_running():
    gate = quiesce.Gate()
    waiting = gate.on_command({"hold_s": 30.0, "wait_s": 20.0, "token": "a"}, lambda: 1)
    gate.on_command({"hold_s": 0.0, "token": "b"}, lambda: 1)
    with pytest.raises(TimeoutError):
        waiting.result(timeout=0.3)
    gate.close()                                       # the frontend stops: the wait ends with it
    assert waiting.result(timeout=5) == (False, CALLED_OFF)


def test_a_wait_that_sees_no_request_acks_ok_and_the_hold_stays():
    gate = quiesce.Gate()
    assert gate.on_command({"hold_s": 30.0, "token": "t"}, lambda: 0).result(timeout=5) == (True, "no request in flight")
    with pytest.raises(Unavailable):
        gate.check()


def test_a_future_is_acked_when_done_and_the_next_command_meanwhile():
    acks: list = []
    slow: Future = Future()
    answers = {"first": slow, "second": (True, "at once")}
    run = [wire.ack_command(lambda c: answers[c.args["n"]],
                            pb.Command(command_id=n, kind=pb.QUIESCE, args_json=f'{{"n": "{n}"}}'), acks.append)
           for n in ("first", "second")]
    assert run[0] is None and (run[1].command_id, run[1].ok, run[1].message) == ("second", True, "at once")
    assert acks == []
    slow.set_result((False, "later"))
    assert [(a.command_id, a.ok, a.message) for a in acks] == [("first", False, "later")]
    broken: Future = Future()
    wire.ack_command(lambda c: broken, pb.Command(command_id="x", kind=pb.QUIESCE, args_json="{}"), acks.append)
    broken.set_exception(RuntimeError("boom"))
    assert (acks[-1].command_id, acks[-1].ok, acks[-1].message) == ("x", False, "RuntimeError: boom")


def test_through_the_master_the_lift_is_acked_while_the_wait_runs(master):  # noqa: F811
    """What `omni sleep --mode wait` and its Ctrl-C send, to a frontend with a request that does not end."""
    server, _ = master
    gate = quiesce.Gate()
    fe = keep_alive(server.address, "FRONTEND", -1, HASH, lambda cmd: gate.on_command(cmd.args, lambda: 1),
                    host="h", pid=300, replica_hint=0)
    admin = MasterClient(server.address)
    waited: list = []
    try:
        wait_until(lambda: [r.state for r in admin.get_status().replicas] == ["READY"])
        asker = threading.Thread(target=lambda: waited.extend(admin.send_command(
            "QUIESCE", (), {"hold_s": 60.0, "wait_s": 50.0, "token": "t"}, timeout_s=55.0)))
        asker.start()
        wait_until(gate.closed, what="the hold never went up")
        t0 = time.monotonic()
        lift = admin.send_command("QUIESCE", (), {"hold_s": 0.0, "token": "t"}, timeout_s=10.0)
        assert [(r.ok, r.message) for r in lift] == [(True, "admitting requests")]
        asker.join(10)
        assert time.monotonic() - t0 < 10 and not asker.is_alive()
        assert [(r.ok, r.message) for r in waited] == [(False, CALLED_OFF)]
        assert not gate.closed()
    finally:
        gate.close()
        admin.close()
        fe.close()
