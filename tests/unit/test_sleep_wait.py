"""Sleep with vLLM's mode=wait (omni/orchestrator/quiesce.py): QUIESCE reaches the API frontends through the
master, each frontend refuses new requests and acks once none is in flight, the stages then sleep, and the
frontends admit again, also when a step fails or the frontend that asked is gone."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from omni._proto import master_pb2 as pb
from omni.errors import BadRequest, ConfigError, Unavailable
from omni.master.client import MasterClient
from omni.master.targets import WaitHolds
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
    assert gate.on_quiesce({"hold_s": 30.0, "token": "a"}, lambda: 0) == (True, "no request in flight")
    with pytest.raises(Unavailable, match="going to sleep .*mode=wait.*wake them after that"):
        gate.check()
    clock.now += 29.0
    with pytest.raises(Unavailable):
        gate.check()
    clock.now += 1.0                               # the frontend that asked never lifted it
    gate.check()
    gate.on_quiesce({"hold_s": 30.0, "token": "a"}, lambda: 0)
    assert gate.on_quiesce({"hold_s": 0.0, "token": "a"}, lambda: 5) == (True, "admitting requests")
    gate.check()


def test_one_sleeps_lift_leaves_another_sleeps_hold_up():
    gate = quiesce.Gate(Clock())
    gate.on_quiesce({"hold_s": 30.0, "token": "a"}, lambda: 0)
    gate.on_quiesce({"hold_s": 30.0, "token": "b"}, lambda: 0)
    gate.on_quiesce({"hold_s": 0.0, "token": "a"}, lambda: 0)
    assert gate.closed()
    gate.on_quiesce({"hold_s": 0.0, "token": "b"}, lambda: 0)
    assert not gate.closed()


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


def test_a_request_past_the_check_when_the_hold_goes_up_is_counted_before_the_ack():
    """check() and the submit that counts the request run in one step of the event loop: the ack waits for
    that step, so it does not answer 'no request in flight' while the request goes on to the stages."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    gate = quiesce.Gate(loop=loop)
    counted, past_check = [0], threading.Event()

    def admit() -> None:          # one loop step: the check, then (later in the same step) the count
        gate.check()
        past_check.set()
        time.sleep(0.3)           # the step is busy elsewhere meanwhile
        counted[0] = 1

    looks = []

    def in_flight() -> int:
        looks.append(counted[0])
        if counted[0] and len(looks) > 2:
            counted[0] = 0        # then it ends
        return counted[0]

    try:
        loop.call_soon_threadsafe(admit)
        assert past_check.wait(10)
        assert gate.on_quiesce({"hold_s": 30.0, "wait_s": 20.0}, in_flight) == (True, "no request in flight")
        assert looks[0] == 1, looks   # before: 0, and the request then went on into the sleep's abort
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


class FakeMaster:
    def __init__(self, quiet_ok: bool = True, fail_sleep: bool = False, frontends=("fe0", "fe1")):
        self.calls: list = []
        self.stage_ids: list = []
        self.replica_ids: list = []
        self.frontends = list(frontends)
        self.quiet_ok, self.fail_sleep = quiet_ok, fail_sleep
        self.holds = WaitHolds()   # as the master: a WAKE_UP while a hold is open is refused


    async def get_status(self):   # Orchestrator.is_sleeping reads it: no stage replica, so not asleep
        return SimpleNamespace(replicas=[])

    async def send_command(self, kind, stage_ids=(), args=None, timeout_s=10.0, replica_ids=()):
        request = pb.SendCommandRequest(kind=pb.CommandKind.Value(kind), args_json=json.dumps(args))
        if self.holds.refusal(request):
            raise ConfigError(self.holds.refusal(request))   # the client's FAILED_PRECONDITION
        self.holds.note(request)
        self.calls.append((kind, {k: v for k, v in args.items() if k != "token"}))
        self.stage_ids.append(tuple(stage_ids))
        self.replica_ids.append(tuple(replica_ids))
        if kind == "QUIESCE":
            ok = self.quiet_ok or not args["hold_s"]
            names = list(replica_ids) or ["fe0", "fe1"]
            return [CommandResult(f, -1, ok or f == "fe0", "ok" if ok or f == "fe0" else
                                  "1 request(s) still in flight after 9 s", "acked") for f in names]
        if self.fail_sleep:
            raise ConnectionError("master gone")
        return [CommandResult("s0r0", 0, True, "sleeping", "acked")]


def test_sleep_when_idle_quiesces_sleeps_with_abort_and_admits_again():
    fake = FakeMaster()
    quiet, slept = asyncio.run(quiesce.sleep_when_idle(fake, 2, 9.0))
    assert [r.ok for r in quiet] == [True, True] and [r.replica_id for r in slept] == ["s0r0"]
    hold = ("QUIESCE", {"hold_s": 39.0, "wait_s": 9.0})
    # twice: the second restarts every hold (a long first wait must not outlast them) and reaches late comers
    assert fake.calls == [hold, hold, ("SLEEP", {"level": 2, "mode": "abort"}), ("QUIESCE", {"hold_s": 0.0})]


def test_a_frontend_that_registered_during_the_wait_holds_too_before_the_sleep():
    fake = FakeMaster()
    real = fake.send_command

    async def send(kind, stage_ids=(), args=None, timeout_s=10.0, replica_ids=()):
        if kind == "QUIESCE" and args["hold_s"] and len(fake.calls) == 1:
            fake.frontends.append("fe2")    # registered while the first hold waited
        out = await real(kind, stage_ids, args, timeout_s, replica_ids)
        if kind != "QUIESCE" or not args["hold_s"]:
            return out
        return out + [CommandResult(f, -1, True, "ok", "acked") for f in fake.frontends[2:]]

    fake.send_command = send
    quiet, slept = asyncio.run(quiesce.sleep_when_idle(fake, 1, 9.0))
    assert [r.replica_id for r in quiet] == ["fe0", "fe1", "fe2"] and slept
    assert [k for k, _ in fake.calls] == ["QUIESCE", "QUIESCE", "SLEEP", "QUIESCE"]


def test_a_frontend_still_busy_means_no_sleep_and_every_frontend_admits_again():
    fake = FakeMaster(quiet_ok=False)
    quiet, slept = asyncio.run(quiesce.sleep_when_idle(fake, 1, 9.0))
    assert slept is None and [r.ok for r in quiet] == [True, False]
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
    assert fake.calls[2] == ("SLEEP", {"level": 1, "mode": "abort"}) and fake.stage_ids == [(), (), (1,), ()]


def test_a_wakeup_while_a_wait_is_under_way_is_a_409_and_the_wait_reports_a_busy_frontend():
    """The 503 told users to wake the stages; a wakeup during the wait answered 200 'awake' and the stages
    slept once the wait ended. Now it is refused until the sleep answers."""
    from omni.errors import Conflict
    from omni.orchestrator.executor import Orchestrator
    from omni.orchestrator.topology import Topology
    from tests.unit.test_orchestrator_replay import CONFIG

    async def run() -> None:
        orch = Orchestrator(CONFIG, frontend_id="fe0-1", topology=Topology(), detokenize=lambda ids: "",
                            master=FakeMaster(quiet_ok=False))
        try:
            await orch.master.send_command("QUIESCE", (), {"hold_s": 30.0, "token": "t"})   # another's sleep
            with pytest.raises(Conflict, match="a sleep with mode=wait is waiting for the requests in flight"):
                await orch.wake_up()
            await orch.master.send_command("QUIESCE", (), {"hold_s": 0.0, "token": "t"})
            assert [r["ok"] for r in (await orch.wake_up())["results"]] == [True]
            out = await orch.sleep(1, "wait")
            assert out["results"] == [] and [f["ok"] for f in out["frontends"]] == [True, False]
        finally:
            await orch.close()

    asyncio.run(run())


def test_the_master_refuses_a_wakeup_while_a_hold_is_open_and_takes_it_after_the_lift():
    """`omni wakeup` (or a frontend the QUIESCE had not reached) answered 'awake' during a wait, and the stages
    slept at its end: the master, which forwards every QUIESCE, knows the holds open."""
    from omni._proto import master_pb2 as pb
    from omni.master.targets import WaitHolds

    clock = Clock()
    holds = WaitHolds(clock)
    wake = pb.SendCommandRequest(kind=pb.WAKE_UP)
    assert holds.refusal(wake) is None
    holds.note(pb.SendCommandRequest(kind=pb.QUIESCE, args_json='{"hold_s": 40, "token": "a"}'))
    assert "a sleep with mode=wait is waiting" in holds.refusal(wake)
    assert holds.refusal(pb.SendCommandRequest(kind=pb.SLEEP)) is None
    holds.note(pb.SendCommandRequest(kind=pb.QUIESCE, args_json='{"hold_s": 0, "token": "a"}'))
    assert holds.refusal(wake) is None
    holds.note(pb.SendCommandRequest(kind=pb.QUIESCE, args_json='{"hold_s": 40, "token": "b"}'))
    clock.now += 41                    # its sleep's frontend died: the hold ran out
    assert holds.refusal(wake) is None
    holds.note(pb.SendCommandRequest(kind=pb.QUIESCE, args_json='{"hold_s": "x"}'))   # no hold, no crash
    assert holds.refusal(wake) is None


def test_a_wait_that_could_not_reach_a_frontend_says_so():
    """A SUSPECT frontend (no keep-alive stream) is no busy one: its requests are unknown, so nothing sleeps,
    and the answer names it as unreachable (api/control.py: 503)."""
    from omni.orchestrator.executor import Orchestrator
    from omni.orchestrator.topology import Topology
    from tests.unit.test_orchestrator_replay import CONFIG

    class Unreached(FakeMaster):
        async def send_command(self, kind, stage_ids=(), args=None, timeout_s=10.0, replica_ids=()):
            out = await super().send_command(kind, stage_ids, args, timeout_s, replica_ids)
            if kind == "QUIESCE" and args["hold_s"]:
                out[1] = CommandResult("fe1", -1, False, "no keep-alive stream (the replica is SUSPECT)",
                                       "disconnected")
            return out

    async def run() -> dict:
        orch = Orchestrator(CONFIG, frontend_id="fe0-1", topology=Topology(), detokenize=lambda ids: "",
                            master=Unreached())
        try:
            return await orch.sleep(1, "wait")
        finally:
            await orch.close()

    out = asyncio.run(run())
    assert out["results"] == [] and out["frontends"][1]["outcome"] == "disconnected"
