"""`omni drain/undrain/sleep/wakeup` find this host's `omni serve` as `omni status` does (its run file):
single-command serve's master port is random, and the worker's 503 tells users to run `omni wakeup`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from omni import runfile
from omni.cli import app
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from tests.unit.test_runfile import run_dir  # noqa: F401 (a fixture: a private OMNI_RUN_DIR)

CFG = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}


@pytest.fixture
def served(run_dir, monkeypatch):
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    path = runfile.write(server.address, "m", None)
    yield server
    runfile.remove(path)
    server.stop(grace=0.2)


@pytest.mark.parametrize("command", ["drain", "undrain", "sleep", "wakeup"])
def test_admin_commands_target_the_local_serve_without_master(served, command):
    r = CliRunner().invoke(app, [command, "--stage", "0", "--timeout", "1"])
    # The master answered: stage 0 is known there, with no replica registered yet.
    assert f"omni {command}: found `omni serve m`" in r.output and served.address in r.output, r.output
    assert f"omni {command}: no live stage replica matched" in r.output, r.output


@pytest.mark.parametrize("command", ["drain", "sleep"])
def test_a_command_the_master_refuses_exits_1_not_the_unreachable_2(served, command):
    """Draining (or sleeping) a stage's last READY replica without --force is the master's FAILED_PRECONDITION:
    a refusal (1, as the module says), not an unreachable master (2, as it was)."""
    from omni.master.registry import RegisterInput, Role

    rep, _ = served.registry.register(RegisterInput(role=Role.STAGE, stage_id=0, host="h", pid=9,
                                               config_hash=hash_config(CFG)))
    served.registry.heartbeat(rep.lease_id, None)   # READY (the master's loop is idle meanwhile)
    r = CliRunner().invoke(app, [command, "--master", served.address, "--stage", "0", "--timeout", "1"])
    assert r.exit_code == 1, r.output
    assert f"{command} would stop stage 0: s0r0 is its last READY, awake replica" in r.output, r.output
    assert "--force" in r.output and "Traceback" not in r.output


def test_force_says_what_stopped_after_the_outcome_and_only_for_replicas_that_acked_ok(run_dir, monkeypatch):
    """`omni sleep --force` printed 'stage 1 will have no READY replica' before sending, then stage 1's replica
    answered that it cannot sleep (Code2Wav): the warning named a stage that kept serving."""
    from tests.unit.master_peers import keep_alive, ready

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}, {"stage_id": 1, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg))
    server.start()
    clients = []
    try:
        for sid, answer in ((0, (True, "asleep")), (1, (False, "Code2WavEngine cannot sleep"))):
            clients.append(keep_alive(server.address, "STAGE", sid, hash_config(cfg), lambda cmd, a=answer: a))
        ready(clients[0], 2)
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--force", "--timeout", "5"])
        assert r.exit_code == 1, r.output     # stage 1 refused
        lines = r.output.splitlines()
        forced = [i for i, line in enumerate(lines) if "--force" in line]
        assert [lines[i] for i in forced] == [
            "omni sleep: --force: stage 0 has no awake READY replica now (s0r0); its requests fail until it is back"]
        table = next(i for i, line in enumerate(lines) if "Code2WavEngine cannot sleep" in line)
        assert forced[0] > table                 # after the outcome it describes
    finally:
        for c in clients:
            c.close()
        server.stop(grace=0.2)


def test_sleep_mode_reaches_the_stages_and_an_unknown_one_is_refused_by_flag(run_dir, monkeypatch):
    from tests.unit.master_peers import keep_alive, ready

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    got = []
    client = keep_alive(server.address, "STAGE", 0, hash_config(CFG), lambda cmd: (got.append(cmd.args), (True, "ok"))[1])
    try:
        ready(client, 1)
        for flags, args in (([], {"level": 1, "mode": "refuse"}), (["--mode", "abort", "--level", "2"],
                                                                   {"level": 2, "mode": "abort"})):
            r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--force", "--timeout", "5", *flags])
            assert r.exit_code == 0 and got[-1] == args, (r.output, got)
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--mode", "keep"])
        assert r.exit_code == 2 and "omni sleep: --mode 'keep': use refuse, abort or wait" in r.output, r.output
        assert len(got) == 2
    finally:
        client.close()
        server.stop(grace=0.2)


def test_sleep_mode_wait_holds_the_frontends_then_sleeps_the_stages_with_abort(run_dir, monkeypatch):
    """`omni sleep --mode wait`: QUIESCE to the frontends (each acks once idle), SLEEP with abort, the lift;
    a frontend still busy: nothing sleeps, exit 1 naming it."""
    from tests.unit.master_peers import keep_alive, ready

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    seen, busy = [], [False]

    def frontend(cmd):
        seen.append(("fe", cmd.kind, cmd.args.get("hold_s")))
        if busy[0] and cmd.args.get("hold_s"):
            return False, "1 request(s) still in flight after 5 s"
        return True, "no request in flight"

    stage = keep_alive(server.address, "STAGE", 0, hash_config(CFG),
                       lambda cmd: (seen.append(("s0", cmd.kind, cmd.args.get("mode"))), (True, "sleeping"))[1])
    fe = keep_alive(server.address, "FRONTEND", -1, hash_config(CFG), frontend, host="h", pid=300, replica_hint=0)
    try:
        ready(stage, 2)
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--mode", "wait", "--force",
                                     "--timeout", "5"])
        assert r.exit_code == 0, r.output
        assert [s[:2] for s in seen] == [("fe", "QUIESCE")] * 2 + [("s0", "SLEEP"), ("fe", "QUIESCE")], seen
        assert seen[2][2] == "abort" and seen[0][2] > 0 and seen[3][2] == 0
        seen.clear()
        busy[0] = True
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--mode", "wait", "--force",
                                     "--timeout", "5"])
        assert r.exit_code == 1 and "nothing was put to sleep" in r.output and "fe0: 1 request(s)" in r.output, r.output
        assert [s[1] for s in seen] == ["QUIESCE", "QUIESCE"]
        # Without --force, the sleep of a stage's last replica is refused before any frontend holds a request
        # (the master's check came at the SLEEP, after the whole wait).
        seen.clear()
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--mode", "wait", "--timeout", "5"])
        assert r.exit_code == 1 and "sleep would stop stage 0 (s0r0)" in r.output and "--force" in r.output, r.output
        assert seen == []
        # A wakeup while a wait holds the frontends is refused by the master (the sleep would undo it).
        from omni.master.client import MasterClient

        with MasterClient(server.address) as c:
            c.send_command("QUIESCE", (), {"hold_s": 30.0, "token": "t"}, timeout_s=5.0)
            r = CliRunner().invoke(app, ["wakeup", "--master", server.address, "--timeout", "5"])
            assert r.exit_code == 1 and "a sleep with mode=wait is waiting" in r.output, r.output
            c.send_command("QUIESCE", (), {"hold_s": 0.0, "token": "t"}, timeout_s=5.0)
        r = CliRunner().invoke(app, ["wakeup", "--master", server.address, "--timeout", "5"])
        assert r.exit_code == 0, r.output
    finally:
        fe.close()
        stage.close()
        server.stop(grace=0.2)


def test_an_interrupted_sleep_mode_wait_lifts_the_holds(run_dir, monkeypatch):
    """Ctrl-C during `omni sleep --mode wait` closed the client, so the lift in the wait's `finally` failed and
    every frontend refused new requests until its hold ran out (--timeout + 30 s)."""
    from omni.master import admin, commands
    from tests.unit.master_peers import keep_alive, ready

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    seen = []
    stage = keep_alive(server.address, "STAGE", 0, hash_config(CFG), lambda cmd: (True, "ok"))
    fe = keep_alive(server.address, "FRONTEND", -1, hash_config(CFG),
                    lambda cmd: (seen.append((cmd.kind, cmd.args)), (True, "ok"))[1], host="h", pid=301, replica_hint=0)
    real, calls = commands.in_thread, []

    def interrupted(fn, stop):   # the status read runs; the wait is "interrupted" at once
        calls.append(fn)
        if len(calls) == 2:
            raise commands.Interrupted()
        return real(fn, stop)

    monkeypatch.setattr(admin, "in_thread", interrupted)
    try:
        ready(stage, 2)
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--mode", "wait", "--force"])
        assert r.exit_code == 130, r.output
        lifts = [args for kind, args in seen if kind == "QUIESCE" and args["hold_s"] == 0]
        assert len(lifts) == 1 and len(lifts[0]["token"]) == 32, seen
    finally:
        fe.close()
        stage.close()
        server.stop(grace=0.2)


@pytest.mark.parametrize("mode", ["refuse", "wait"])
def test_a_stage_that_cannot_sleep_is_not_a_stage_a_sleep_would_stop(run_dir, monkeypatch, mode):
    """`omni sleep --stage 1` of a talker that cannot sleep was refused as stopping 's1r0, its last READY,
    awake replica' (found by a soak): it acks "cannot sleep" and serves on, so only its own refusal is left."""
    from tests.unit.master_peers import keep_alive, ready

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}, {"stage_id": 1, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg))
    server.start()
    seen = []
    clients = [keep_alive(server.address, "STAGE", 0, hash_config(cfg)),
               keep_alive(server.address, "STAGE", 1, hash_config(cfg),
                          lambda cmd: (seen.append(cmd.kind), (False, "TalkerEngine cannot sleep"))[1],
                          capabilities={"can_sleep": "false"}),
               keep_alive(server.address, "FRONTEND", -1, hash_config(cfg), lambda cmd: (True, "no request in flight"),
                          host="h", pid=300, replica_hint=0)]
    try:
        ready(clients[0], 3)
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--stage", "1", "--mode", mode,
                                     "--timeout", "5"])
        assert r.exit_code == 1 and "TalkerEngine cannot sleep" in r.output, r.output
        assert "would stop" not in r.output and seen == ["SLEEP"], r.output
        r = CliRunner().invoke(app, ["sleep", "--master", server.address, "--stage", "0", "--mode", mode,
                                     "--timeout", "5"])   # stage 0 can: its last replica is still kept serving
        assert r.exit_code == 1 and "would stop stage 0" in r.output, r.output
    finally:
        for c in clients:
            c.close()
        server.stop(grace=0.2)
