"""Conversions between registry objects, protobuf messages and the client-side Structs."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import socket
from concurrent.futures import Future
from typing import Callable

from omni._proto import master_pb2 as pb
from omni.errors import BadRequest
from omni.master import types
from omni.master.registry import Replica

logger = logging.getLogger(__name__)


def replica_to_pb(rep: Replica, heartbeat_age_s: float) -> pb.ReplicaInfo:
    load = rep.load
    return pb.ReplicaInfo(
        stage_id=rep.stage_id, replica_id=rep.replica_id, replica_index=rep.index,
        role=pb.Role.Value(rep.role.value), host=rep.host, pid=rep.pid, endpoints=rep.endpoints,
        state=pb.ReplicaState.Value(rep.state.value), queue_len=load.queue_len, in_flight=load.in_flight,
        requests_total=load.requests_total, cpu_seconds=load.cpu_seconds, is_sleeping=load.is_sleeping,
        draining=rep.draining, extra=load.extra, heartbeat_age_s=heartbeat_age_s, version=rep.version,
        capabilities=rep.capabilities,
    )


def replica_from_pb(m: pb.ReplicaInfo) -> types.ReplicaInfo:
    return types.ReplicaInfo(
        stage_id=m.stage_id, replica_id=m.replica_id, replica_index=m.replica_index,
        role=pb.Role.Name(m.role), host=m.host, pid=m.pid, endpoints=dict(m.endpoints),
        state=pb.ReplicaState.Name(m.state), queue_len=m.queue_len, in_flight=m.in_flight,
        requests_total=m.requests_total, cpu_seconds=m.cpu_seconds, is_sleeping=m.is_sleeping,
        draining=m.draining, extra=dict(m.extra), heartbeat_age_s=round(m.heartbeat_age_s, 3),
        version=m.version, capabilities=dict(m.capabilities),
    )


def _json_or_empty(text: str) -> dict:
    return json.loads(text) if text else {}


def status_from_pb(m: pb.StatusResponse) -> types.Status:
    return types.Status(
        replicas=[replica_from_pb(r) for r in m.replicas],
        stages=[types.StageStatus(s.stage_id, s.ready_replicas, s.live_replicas) for s in m.stages],
        config_hash=m.config_hash, has_config=m.has_config, lease_ttl_s=m.lease_ttl_s,
        pipeline_config=_json_or_empty(m.pipeline_config_json),
    )


def event_from_pb(m: pb.TopologyEvent) -> types.TopologyEvent:
    return types.TopologyEvent(kind=pb.TopologyEvent.Kind.Name(m.kind),
                               replicas=[replica_from_pb(r) for r in m.replicas], seq=m.seq)


def registration_from_pb(m: pb.RegisterResponse) -> types.Registration:
    return types.Registration(
        replica_id=m.replica_id, replica_index=m.replica_index, lease_id=m.lease_id, lease_ttl_s=m.lease_ttl_s,
        stage_config=_json_or_empty(m.stage_config_json), pipeline_config=_json_or_empty(m.pipeline_config_json))


def command_from_pb(m: pb.Command) -> types.Command:
    return types.Command(command_id=m.command_id, kind=pb.CommandKind.Name(m.kind),
                         args=_json_or_empty(m.args_json))


def ack_command(on_command: Callable[[types.Command], "tuple[bool, str] | Future | None"], msg: pb.Command,
                later: Callable[[pb.CommandAck], None]) -> pb.CommandAck | None:
    """Run one command from the keep-alive stream; whatever happens, its ack (the stream lives on). A handler
    that returns a Future answers later: None now, and `later` gets the ack once the Future is done (the
    commands after it run meanwhile)."""
    if msg.kind not in pb.CommandKind.values():   # a newer master's kind (version skew in an upgrade)
        logger.warning("refused command %s: unknown kind %d (an older omni than the master's?)",
                       msg.command_id[:8], msg.kind)
        return pb.CommandAck(command_id=msg.command_id, ok=False, message=f"unknown command {msg.kind}")
    try:
        cmd = command_from_pb(msg)
        result = on_command(cmd)
        if isinstance(result, Future):
            result.add_done_callback(lambda f: later(_ack(msg, f.result)))
            return None
    except Exception as e:
        return _failed(msg, e)
    return _ack(msg, lambda: result)


def _ack(msg: pb.Command, result: Callable[[], "tuple[bool, str] | None"]) -> pb.CommandAck:
    try:
        got = result()
        ok, message = got if got is not None else (True, "")
    except Exception as e:
        return _failed(msg, e)
    return pb.CommandAck(command_id=msg.command_id, ok=bool(ok), message=str(message))


def _failed(msg: pb.Command, e: Exception) -> pb.CommandAck:
    logger.warning("command %s failed: %s", pb.CommandKind.Name(msg.kind), e)
    return pb.CommandAck(command_id=msg.command_id, ok=False, message=f"{type(e).__name__}: {e}")


def results_from_pb(m: pb.SendCommandResponse) -> list[types.CommandResult]:
    return [types.CommandResult(r.replica_id, r.stage_id, r.ok, r.message, r.outcome) for r in m.results]


_LOAD_FIELDS = {"queue_len": int, "in_flight": int, "requests_total": int, "cpu_seconds": float,
                "is_sleeping": bool, "draining": bool}


def heartbeat_from_load(load: dict, lease_id: str, replica_id: str, acks: list[pb.CommandAck]) -> pb.Heartbeat:
    """Known keys fill the Heartbeat fields; other numeric keys (and an 'extra' dict) go to extra."""
    fields = {}
    extra = {k: float(v) for k, v in (load.get("extra") or {}).items()}
    for key, value in load.items():
        if key in _LOAD_FIELDS:
            fields[key] = _LOAD_FIELDS[key](value)
        elif key != "extra" and isinstance(value, (int, float)):
            extra[key] = float(value)
    return pb.Heartbeat(lease_id=lease_id, replica_id=replica_id, extra=extra, acks=acks, **fields)


def command_kind(kind: str) -> int:
    try:
        value = pb.CommandKind.Value(kind.upper())
    except ValueError:
        value = 0
    if value == 0:
        known = ", ".join(n for n in pb.CommandKind.keys() if n != "COMMAND_UNSPECIFIED")
        raise ValueError(f"unknown command kind {kind!r}; use one of {known}")
    return value


def omni_version() -> str:
    try:
        return importlib.metadata.version("omni")
    except importlib.metadata.PackageNotFoundError:
        return ""


def register_request(role: str, stage_id: int, host: str | None, pid: int | None, replica_hint: int,
                      endpoints: dict | None, config_hash: str, pipeline_config: dict | None, version: str | None,
                      capabilities: dict | None, instance_id: str = "") -> pb.RegisterRequest:
    try:
        role_value = pb.Role.Value(role.upper())
    except ValueError:
        raise BadRequest(f"role must be STAGE or FRONTEND, got {role!r}") from None
    return pb.RegisterRequest(
        role=role_value, stage_id=stage_id, replica_hint=replica_hint, host=host or socket.gethostname(),
        pid=os.getpid() if pid is None else pid, endpoints=endpoints or {}, config_hash=config_hash,
        pipeline_config_json=json.dumps(pipeline_config) if pipeline_config is not None else "",
        version=version if version is not None else omni_version(),
        capabilities={k: str(v) for k, v in (capabilities or {}).items()}, instance_id=instance_id)


def send_command_request(kind, stage_ids, args, timeout_s, replica_ids, keep_serving=False) -> pb.SendCommandRequest:
    stage_ids, replica_ids = list(stage_ids), list(replica_ids)
    if stage_ids and replica_ids:
        raise BadRequest("stage_ids and replica_ids: give one, not both (a replica id names its stage)")
    try:
        kind_value = command_kind(kind)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return pb.SendCommandRequest(stage_ids=list(stage_ids), kind=kind_value, args_json=json.dumps(args or {}),
                                 timeout_s=timeout_s, replica_ids=list(replica_ids), keep_serving=keep_serving)
