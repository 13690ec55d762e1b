"""The master and its clients against malformed or unexpected input: a clear refusal, never a crash or a
broken keep-alive stream."""

from __future__ import annotations

import json

import grpc
import pytest

from omni._proto import master_pb2 as pb
from omni._proto import master_pb2_grpc as pb_grpc
from omni.errors import BadRequest
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from omni.master.types import Registration
from tests.unit.master_peers import keep_alive, wait_until

CFG = {"model": "m", "stages": [{"stage_id": 0, "name": "a"}, {"stage_id": 1, "name": "b"}]}
HASH = hash_config(CFG)


@pytest.fixture
def master():
    server = MasterServer(CFG, HASH, lease_ttl_s=5.0)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, pb_grpc.MasterStub(channel)
    finally:
        channel.close()
        server.stop(grace=0.2)


def _stage(address: str, stage_id: int, pid: int, got: list) -> MasterClient:
    return keep_alive(address, "STAGE", stage_id, HASH, lambda cmd: (got.append(cmd.kind), (True, cmd.kind))[1],
                      host="h", pid=pid)


# -- an unknown command kind (version skew) -----------------------------------------------------
class _FakeStub:
    def __init__(self, commands):
        self.commands = commands

    def KeepAlive(self, heartbeats, metadata=None):
        return iter(self.commands)


def test_a_stage_acks_a_command_kind_it_cannot_name_and_keeps_its_stream():
    """A newer master's kind reaches an older stage: it acks 'unknown command N' and reads on (it raised out of
    the stream's reader: the stream broke, the replica went SUSPECT, the frontends replayed its requests)."""
    c = MasterClient("127.0.0.1:1")
    c._registration = Registration("s0r0", 0, "lease", 5.0, {}, {})
    c._stub = _FakeStub([pb.Command(command_id="new", kind=99),
                         pb.Command(command_id="d", kind=pb.DRAIN, args_json="{}")])
    got = []
    c._run_stream(lambda: {}, lambda cmd: got.append(cmd.kind) or (True, "drained"), 0.1)
    acks = [c._acks.get_nowait() for _ in range(2)]
    assert [(a.command_id, a.ok, a.message) for a in acks] == [("new", False, "unknown command 99"),
                                                                ("d", True, "drained")]
    assert got == ["DRAIN"]
    c.close()


def test_the_master_refuses_a_command_kind_it_cannot_name_before_sending_it(master):
    server, stub = master
    got: list = []
    stage = _stage(server.address, 0, 100, got)
    try:
        wait_until(lambda: stage.get_status().replicas[0].state == "READY")
        with pytest.raises(grpc.RpcError) as e:
            stub.SendCommand(pb.SendCommandRequest(kind=99, timeout_s=1.0))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown command kind 99" in e.value.details() and "DRAIN" in e.value.details()
        results = stage.send_command("WAKE_UP", timeout_s=5.0)
        assert [(r.replica_id, r.ok) for r in results] == [("s0r0", True)] and got == ["WAKE_UP"]
        assert stage.registrations == 1 and stage.last_error is None
    finally:
        stage.close()


# -- a malformed Register -----------------------------------------------------------------------
def _register(stub, **fields):
    base = dict(role=pb.STAGE, stage_id=0, host="h", pid=1, config_hash=HASH)
    return stub.Register(pb.RegisterRequest(**{**base, **fields}))


def _refused(fn) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    return e.value.details()


@pytest.mark.parametrize("cfg, says", [([1, 2], "pipeline_config_json must be a JSON object, got list"),
                                       ("s", "pipeline_config_json must be a JSON object, got str")])
def test_register_refuses_a_pipeline_config_that_is_no_object(cfg, says):
    server = MasterServer(None, lease_ttl_s=5.0)     # the first registrant's config is adopted
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.MasterStub(channel)
        assert says in _refused(lambda: _register(stub, config_hash="x", pipeline_config_json=json.dumps(cfg)))
        bad_id = {"stages": [{"stage_id": [0]}]}
        assert "stages[0].stage_id must be an integer" in _refused(
            lambda: _register(stub, config_hash="x", pipeline_config_json=json.dumps(bad_id)))
        assert _register(stub, config_hash="x", pipeline_config_json=json.dumps(CFG)).replica_id == "s0r0"
    finally:
        channel.close()
        server.stop(grace=0.2)


def test_register_refuses_an_unknown_role_by_name(master):
    _, stub = master
    assert "role must be STAGE or FRONTEND, got 7" in _refused(lambda: _register(stub, role=7))
    # a mismatching registrant's config of another shape: refused, not a crash in the diff
    assert "must be a JSON object" in _refused(lambda: _register(stub, config_hash="y", pipeline_config_json="[1]"))


def test_stages_by_id_names_a_config_of_another_shape():
    from omni.master.configdiff import stages_by_id

    for bad in ([1], "s", None):
        with pytest.raises(ValueError, match="pipeline config must be an object"):
            stages_by_id(bad)
    with pytest.raises(ValueError, match=r"stages\[0\].stage_id must be an integer, got 'a'"):
        stages_by_id({"stages": [{"stage_id": "a"}]})


# -- --stage with --replica ---------------------------------------------------------------------
def test_a_command_naming_stages_and_replicas_is_refused_not_half_read(master):
    """`omni drain --stage 0 --replica s1r0` drained s1r0 of stage 1: the stages were dropped silently."""
    server, stub = master
    got0: list = []
    got1: list = []
    stages = [_stage(server.address, 0, 100, got0), _stage(server.address, 1, 101, got1)]
    admin = MasterClient(server.address)
    try:
        wait_until(lambda: all(r.state == "READY" for r in admin.get_status().replicas))
        assert "give one, not both" in _refused(lambda: stub.SendCommand(pb.SendCommandRequest(
            kind=pb.DRAIN, stage_ids=[0], replica_ids=["s1r0"], timeout_s=1.0)))
        with pytest.raises(BadRequest, match="stage_ids and replica_ids: give one, not both"):
            admin.send_command("DRAIN", stage_ids=[0], replica_ids=["s1r0"])
        assert got0 == got1 == [] and {r.state for r in admin.get_status().replicas} == {"READY"}
    finally:
        admin.close()
        for c in stages:
            c.close()


def test_a_command_aimed_at_a_frontend_is_refused_naming_it(master):
    """DRAIN/SLEEP/SHUTDOWN with replica_ids=['fe0'] answered ok=True: the frontend acks every command
    ("ignored by frontends") and does nothing."""
    server, stub = master
    acked: list = []
    fe = keep_alive(server.address, "FRONTEND", -1, HASH, lambda cmd: (acked.append(cmd.kind), (True, "ignored"))[1],
                    host="h", pid=200, replica_hint=0)
    admin = MasterClient(server.address)
    try:
        wait_until(lambda: [(r.replica_id, r.state) for r in admin.get_status().replicas] == [("fe0", "READY")])
        for kind in ("DRAIN", "SLEEP", "SHUTDOWN"):
            with pytest.raises(BadRequest, match="replica 'fe0' is an API frontend; commands reach stage replicas"):
                admin.send_command(kind, (), {}, replica_ids=["fe0"], timeout_s=1.0)
        assert acked == []
    finally:
        admin.close()
        fe.close()


def test_the_cli_refuses_stage_with_replica_by_flag_before_calling(monkeypatch):
    from typer.testing import CliRunner

    from omni.cli import app

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    r = CliRunner().invoke(app, ["drain", "--master", "127.0.0.1:1", "--stage", "0", "--replica", "s1r0"])
    assert r.exit_code == 2, r.output
    assert "omni drain: --stage and --replica: give one, not both" in r.output, r.output


def test_a_command_timeout_that_is_nan_negative_or_infinite_is_refused_before_sending(master):
    """NaN and -1 were accepted: the DRAIN went down the stream, the master waited for no ack, answered
    'no ack within nan s' and never marked the replica DRAINING although it drained."""
    server, stub = master
    got: list = []
    stage = _stage(server.address, 0, 100, got)
    try:
        wait_until(lambda: stage.get_status().replicas[0].state == "READY")
        for t in (float("nan"), -1.0, float("inf"), float("-inf")):
            says = _refused(lambda t=t: stub.SendCommand(pb.SendCommandRequest(kind=pb.DRAIN, timeout_s=t)))
            assert "timeout_s must be a finite number of seconds >= 0" in says, says
        assert got == [] and stage.get_status().replicas[0].state == "READY"
        results = stage.send_command("WAKE_UP", timeout_s=0)        # 0 is the default wait
        assert [(r.replica_id, r.ok) for r in results] == [("s0r0", True)] and got == ["WAKE_UP"]
    finally:
        stage.close()


def test_an_unknown_command_kind_names_every_known_one():
    from omni.master import wire

    with pytest.raises(ValueError) as e:
        wire.command_kind("pause")
    for name in pb.CommandKind.keys():
        assert (name in str(e.value)) == (name != "COMMAND_UNSPECIFIED"), str(e.value)


@pytest.mark.parametrize("value", ["inf", "601"])
def test_the_cli_refuses_a_timeout_the_master_would_not_wait_by_flag(monkeypatch, value):
    from typer.testing import CliRunner

    from omni.cli import app
    from omni.master import admin, server

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    for verb in ("drain", "undrain", "sleep", "wakeup"):
        r = CliRunner().invoke(app, [verb, "--master", "127.0.0.1:1", "--timeout", value])
        assert r.exit_code == 2 and "--timeout" in r.output, (verb, r.output)    # before: cannot reach
    assert admin.MAX_TIMEOUT_S == server.MAX_COMMAND_TIMEOUT_S
