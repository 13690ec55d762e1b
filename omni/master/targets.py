"""Which replicas a SendCommand reaches, and the refusal of one that would stop a stage's last serving
replica: pure functions of the registry, applied by the servicer (omni/master/server.py)."""

from __future__ import annotations

import json
import math
import time
from typing import Callable

from omni._proto import master_pb2 as pb
from omni.master.registry import LIVE_STATES, Registry, ReplicaState, Role

# a WAKE_UP while a sleep with mode=wait waits (WaitHolds; HTTP: the frontend answers it as a 409)
WAKE_REFUSED = ("a sleep with mode=wait is waiting for the requests in flight: the stages sleep once they end; "
                "wake them after that sleep answers")


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


class WaitHolds:
    """The QUIESCE holds open on the frontends (a sleep with mode=wait under way), by token: a WAKE_UP sent
    meanwhile, through any frontend or the CLI, would be undone by the sleep at the wait's end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._until: dict[str, float] = {}

    def note(self, request: pb.SendCommandRequest) -> None:
        if request.kind != pb.QUIESCE:
            return
        args = json.loads(request.args_json or "{}")   # valid JSON: the servicer checked it
        args = args if isinstance(args, dict) else {}
        token = str(args.get("token", ""))
        try:
            hold_s = float(args.get("hold_s", 0.0))
        except (TypeError, ValueError):
            hold_s = 0.0
        if hold_s > 0 and math.isfinite(hold_s):
            self._until[token] = self.clock() + min(hold_s, 3600.0)
        else:
            self._until.pop(token, None)

    def refusal(self, request: pb.SendCommandRequest) -> str | None:
        if request.kind != pb.WAKE_UP:
            return None
        now = self.clock()
        self._until = {t: u for t, u in self._until.items() if u > now}
        return WAKE_REFUSED if self._until else None
