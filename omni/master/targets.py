"""Which replicas a SendCommand reaches, and the refusal of one that would stop a stage's last serving
replica: pure functions of the registry, applied by the servicer (omni/master/server.py)."""

from __future__ import annotations

from omni._proto import master_pb2 as pb
from omni.master.registry import LIVE_STATES, Registry, ReplicaState, Role


def command_targets(reg: Registry, request: pb.SendCommandRequest):
    """-> (replicas, None), or ([], why the request is refused)."""
    if request.kind == pb.QUIESCE:
        return _frontends(reg, request)
    if request.replica_ids and request.stage_ids:   # neither may be dropped silently, nor guessed at
        return [], "stage_ids and replica_ids: give one, not both (a replica id names its stage)"
    if request.replica_ids:
        reps = []
        for rid in request.replica_ids:
            rep = reg.by_replica_id(rid)
            if rep is None or rep.state is ReplicaState.DEAD:
                return [], f"no live replica {rid!r}"
            if rep.role is not Role.STAGE:   # a frontend acks a command and does nothing: never a false ok
                return [], f"replica {rid!r} is an API frontend; commands reach stage replicas only"
            reps.append(rep)
        return reps, None
    known = set(reg.stage_ids())
    wanted = set(request.stage_ids) or known
    unknown = sorted(wanted - known)
    if unknown:
        return [], f"stage(s) {', '.join(map(str, unknown))} not in the pipeline (stages: {sorted(known)})"
    # SLEEP/WAKE_UP reach every live replica: one without a keep-alive stream (SUSPECT, REGISTERING) is
    # reported "disconnected", not skipped (it would come back awake, or asleep, unnoticed).
    ok_states = {pb.DRAIN: {ReplicaState.READY}, pb.UNDRAIN: {ReplicaState.DRAINING}, pb.SLEEP: LIVE_STATES,
                 pb.WAKE_UP: LIVE_STATES}.get(request.kind, {ReplicaState.READY, ReplicaState.DRAINING})
    return [r for r in reg.replicas()
            if r.role is Role.STAGE and r.stage_id in wanted and r.state in ok_states], None


def _frontends(reg: Registry, request: pb.SendCommandRequest):
    """QUIESCE reaches API frontends (all live ones, or those named), never a stage replica."""
    if request.stage_ids:
        return [], "QUIESCE reaches API frontends: stage_ids do not apply"
    live = [r for r in reg.replicas() if r.role is Role.FRONTEND and r.state in LIVE_STATES]
    if not request.replica_ids:
        return live, None
    by_id = {r.replica_id: r for r in live}
    for rid in request.replica_ids:
        if rid not in by_id:
            return [], f"no live API frontend {rid!r}"
    return [by_id[rid] for rid in request.replica_ids], None


def would_stop(kind: int, stopped: dict[int, list[str]], reg: Registry, pending: set[str]) -> str:
    verb = {pb.DRAIN: "drain", pb.SLEEP: "sleep"}[kind]
    undo = {pb.DRAIN: "omni undrain", pb.SLEEP: "omni wakeup"}[kind]
    parts = []
    for sid, rids in sorted(stopped.items()):
        name = reg.stage_config(sid).get("name")
        parts.append(f"stage {sid}" + (f" ({name})" if name else "") + f": {', '.join(rids)} "
                     + ("is its last" if len(rids) == 1 else "are its last") + " READY, awake replica"
                     + ("" if len(rids) == 1 else "s")
                     + "".join(f" ({rid}: a drain or sleep is being sent to it)" for rid in rids if rid in pending))
    return (f"{verb} would stop {'; '.join(parts)}; its requests would fail until `{undo}`. "
            "Repeat with --force to do it anyway")
