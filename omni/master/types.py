"""What the master clients return: frozen msgspec Structs (JSON-encodable for `omni status --json`)."""

from __future__ import annotations

import msgspec



def sleep_stops(capabilities: dict[str, str]) -> bool:
    """Whether a SLEEP stops this replica serving: all but one whose capability says it cannot sleep (it acks
    "cannot sleep" and serves on). Read by the master's last-replica check and the CLI's --mode wait precheck."""
    return capabilities.get("can_sleep") != "false"

class Registration(msgspec.Struct, frozen=True):
    replica_id: str
    replica_index: int
    lease_id: str
    lease_ttl_s: float
    stage_config: dict
    pipeline_config: dict


class Command(msgspec.Struct, frozen=True):
    command_id: str
    kind: str  # DRAIN | SLEEP | WAKE_UP | SHUTDOWN
    args: dict


class ReplicaInfo(msgspec.Struct, frozen=True):
    stage_id: int  # -1 for frontends
    replica_id: str
    replica_index: int
    role: str  # STAGE | FRONTEND
    host: str
    pid: int
    endpoints: dict[str, str]
    state: str  # REGISTERING | READY | DRAINING | SUSPECT | DEAD
    queue_len: int
    in_flight: int
    requests_total: int
    cpu_seconds: float
    is_sleeping: bool
    draining: bool
    extra: dict[str, float]
    heartbeat_age_s: float
    version: str
    capabilities: dict[str, str]


class StageStatus(msgspec.Struct, frozen=True):
    stage_id: int
    ready_replicas: int
    live_replicas: int


class Status(msgspec.Struct, frozen=True):
    replicas: list[ReplicaInfo]
    stages: list[StageStatus]
    config_hash: str
    has_config: bool
    lease_ttl_s: float
    pipeline_config: dict

    def ready(self, stage_id: int) -> list[ReplicaInfo]:
        """The stage's READY replicas, asleep or not."""
        return [r for r in self.replicas if r.role == "STAGE" and r.stage_id == stage_id and r.state == "READY"]

    def serving(self, stage_id: int) -> list[ReplicaInfo]:
        """The stage's replicas that serve: READY and awake (an asleep one answers every request with a 503)."""
        return [r for r in self.ready(stage_id) if not r.is_sleeping]

    def problems(self) -> list[str]:
        """Why the pipeline cannot serve; empty when every stage has a serving replica."""
        if not self.has_config:
            return ["the master has no pipeline config yet (nothing has registered)"]
        out = []
        for s in self.stages:
            ready = self.ready(s.stage_id)
            if s.ready_replicas == 0:
                out.append(f"stage {s.stage_id} has no READY replica")
            elif ready and not self.serving(s.stage_id):
                out.append(f"stage {s.stage_id} has no awake READY replica ({', '.join(r.replica_id for r in ready)} "
                           f"asleep: `omni wakeup --stage {s.stage_id}`)")
        return out


class TopologyEvent(msgspec.Struct, frozen=True):
    kind: str  # SNAPSHOT | ADDED | UPDATED | REMOVED
    replicas: list[ReplicaInfo]
    seq: int


class CommandResult(msgspec.Struct, frozen=True):
    replica_id: str
    stage_id: int
    ok: bool
    message: str
    outcome: str  # acked | timeout | disconnected
