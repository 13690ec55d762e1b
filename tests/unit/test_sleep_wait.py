"""Sleep with vLLM's mode=wait (omni/orchestrator/quiesce.py): QUIESCE reaches the API frontends through the
master, each frontend refuses new requests and acks once none is in flight, the stages then sleep, and the
frontends admit again, also when a step fails or the frontend that asked is gone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omni.errors import BadRequest, Unavailable
from omni.master.client import MasterClient
from omni.master.types import CommandResult
from omni.orchestrator import quiesce
from tests.unit.master_peers import keep_alive, wait_until
from tests.unit.test_master_bad_input import HASH, master  # noqa: F401


def test_quiesce_reaches_the_frontends_and_no_stage(master):  # noqa: F811
    server, _ = master
    got: dict[str, list] = {"fe": [], "stage": []}

    def on(who):
        return lambda cmd: (got[who].append((cmd.kind, cmd.args)), (True, f"{who} did it"))[1]

    fe = keep_alive(server.address, "FRONTEND", -1, HASH, on("fe"), host="h", pid=200, replica_hint=0)
    stage = keep_alive(server.address, "STAGE", 0, HASH, on("stage"), host="h", pid=201)
    admin = MasterClient(server.address)
    try:
        wait_until(lambda: sorted(r.state for r in admin.get_status().replicas) == ["READY", "READY"])
        results = admin.send_command("QUIESCE", (), {"hold_s": 5.0}, timeout_s=5.0)
        assert [(r.replica_id, r.ok, r.message) for r in results] == [("fe0", True, "fe did it")]
        assert got == {"fe": [("QUIESCE", {"hold_s": 5.0})], "stage": []}
        with pytest.raises(BadRequest, match="QUIESCE reaches API frontends: stage_ids do not apply"):
            admin.send_command("QUIESCE", (0,), {}, timeout_s=1.0)
        with pytest.raises(BadRequest, match="no live API frontend 's0r0'"):
            admin.send_command("QUIESCE", (), {}, replica_ids=["s0r0"], timeout_s=1.0)
        assert [r.replica_id for r in admin.send_command("QUIESCE", (), {}, replica_ids=["fe0"])] == ["fe0"]
    finally:
        admin.close()
        fe.close()
        stage.close()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_gate_refuses_new_requests_until_lifted_or_its_hold_ends():
    clock = Clock()
    gate = quiesce.Gate(clock)
    gate.check()                                   # open
    assert gate.on_quiesce({"hold_s": 30.0}, lambda: 0) == (True, "no request in flight")
    with pytest.raises(Unavailable, match="going to sleep .*mode=wait"):
        gate.check()
    clock.now += 29.0
    with pytest.raises(Unavailable):
        gate.check()
    clock.now += 1.0                               # the frontend that asked never lifted it
    gate.check()
    gate.on_quiesce({"hold_s": 30.0}, lambda: 0)
    assert gate.on_quiesce({"hold_s": 0.0}, lambda: 5) == (True, "admitting requests")
    gate.check()


def test_the_ack_waits_for_the_requests_in_flight_to_end():
    gate = quiesce.Gate()
    left = [3]
    ended = threading.Event()

    def in_flight() -> int:
        if left[0]:
            left[0] -= 1                           # one ends at each look
        else:
            ended.set()
        return left[0]

    assert gate.on_quiesce({"hold_s": 30.0, "wait_s": 20.0}, in_flight) == (True, "no request in flight")
    assert ended.is_set()
    ok, message = gate.on_quiesce({"hold_s": 30.0, "wait_s": 0.1}, lambda: 2)
    assert not ok and message == "2 request(s) still in flight after 0.1 s"
    with pytest.raises(Unavailable):              # held all the same: the one who asked lifts it
        gate.check()


class FakeMaster:
    def __init__(self, quiet_ok: bool = True, fail_sleep: bool = False):
        self.calls: list = []
        self.stage_ids: list = []
        self.quiet_ok, self.fail_sleep = quiet_ok, fail_sleep

    async def send_command(self, kind, stage_ids=(), args=None, timeout_s=10.0, replica_ids=()):
        self.calls.append((kind, args))
        self.stage_ids.append(tuple(stage_ids))
        if kind == "QUIESCE":
            ok = self.quiet_ok or not args["hold_s"]
            return [CommandResult("fe0", -1, True, "no request in flight", "acked"),
                    CommandResult("fe1", -1, ok, "ok" if ok else "1 request(s) still in flight after 9 s", "acked")]
        if self.fail_sleep:
            raise ConnectionError("master gone")
        return [CommandResult("s0r0", 0, True, "sleeping", "acked")]


def test_sleep_when_idle_quiesces_sleeps_with_abort_and_admits_again():
    fake = FakeMaster()
    quiet, slept = asyncio.run(quiesce.sleep_when_idle(fake, 2, 9.0))
    assert [r.ok for r in quiet] == [True, True] and [r.replica_id for r in slept] == ["s0r0"]
    assert fake.calls == [("QUIESCE", {"hold_s": 39.0, "wait_s": 9.0}), ("SLEEP", {"level": 2, "mode": "abort"}),
                          ("QUIESCE", {"hold_s": 0.0})]


def test_a_frontend_still_busy_means_no_sleep_and_every_frontend_admits_again():
    fake = FakeMaster(quiet_ok=False)
    quiet, slept = asyncio.run(quiesce.sleep_when_idle(fake, 1, 9.0))
    assert slept == [] and [r.ok for r in quiet] == [True, False]
    assert [k for k, _ in fake.calls] == ["QUIESCE", "QUIESCE"] and fake.calls[-1][1] == {"hold_s": 0.0}


def test_the_gates_are_lifted_when_the_sleep_fails():
    fake = FakeMaster(fail_sleep=True)
    with pytest.raises(ConnectionError):
        asyncio.run(quiesce.sleep_when_idle(fake, 1, 9.0))
    assert fake.calls[-1] == ("QUIESCE", {"hold_s": 0.0})


def test_stage_ids_outside_the_pipeline_are_refused_naming_them():
    from omni.errors import BadRequest as Bad

    quiesce.check_stage_ids((0, 2), [0, 1, 2])
    with pytest.raises(Bad, match=r"stage_ids: 3, 7 not in the pipeline \(stages: 0, 1, 2\)"):
        quiesce.check_stage_ids((7, 0, 3), [0, 1, 2])


def test_sleep_when_idle_sleeps_only_the_stages_named():
    fake = FakeMaster()
    asyncio.run(quiesce.sleep_when_idle(fake, 1, 9.0, (1,)))
    assert fake.calls[1] == ("SLEEP", {"level": 1, "mode": "abort"}) and fake.stage_ids == [(), (1,), ()]
