"""Which replica of a stage takes a request's work there.

Among the stage's READY replicas (on one host when the request's inputs there are in shared
memory) that can take the request (limits.fitting), awake ones first: a sleeping replica is
picked only when no awake one is left, so the client gets its "asleep, `omni wakeup`" answer
instead of a plain "no replica". Then the least loaded (`load`: the core's key).
"""

from __future__ import annotations

from typing import Callable

from omni.config import StageConfig
from omni.errors import Unavailable
from omni.master.types import ReplicaInfo
from omni.orchestrator.limits import fitting
from omni.orchestrator.types import PipelineRequest


def awake_first(replicas: list[ReplicaInfo]) -> list[ReplicaInfo]:
    """The awake replicas, or all of them when every one sleeps."""
    return [r for r in replicas if not r.is_sleeping] or replicas


def pick(stage: StageConfig, replicas: list[ReplicaInfo], req: PipelineRequest | None, host: str | None,
         load: Callable[[ReplicaInfo], tuple]) -> ReplicaInfo:
    """A replica for `stage` out of its READY `replicas`; Unavailable when none is (on `host`)."""
    replicas = [r for r in replicas if host is None or r.host == host]
    if not replicas:
        raise Unavailable(f"{stage.label} has no READY replica"
                          + (f" on {host}, where its input's shared-memory tensors are" if host else ""))
    return min(awake_first(fitting(stage, replicas, req)), key=load)


def replay_target(replicas: list[ReplicaInfo], dead: ReplicaInfo, same_host: bool,
                  load: Callable[[ReplicaInfo], tuple]) -> ReplicaInfo | None:
    """Where a stage's part of a request moves from `dead` (on its host when `same_host`); None: nowhere."""
    others = [r for r in replicas if r.replica_id != dead.replica_id and (not same_host or r.host == dead.host)]
    return min(awake_first(others), key=load) if others else None
