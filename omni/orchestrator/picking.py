"""Which replica of a stage takes a request's work there.

Among the stage's READY replicas (on one host when the request's inputs there are in shared
memory) that can take the request (limits.fitting), awake ones first: a sleeping replica is
picked only when no awake one is left, so the client gets its "asleep, `omni wakeup`" answer
instead of a plain "no replica". Then the least loaded (`load`: the core's key). A replay never
goes back to a replica process the stage's part of the request may have run on unheard (`not_again`,
StageState): one that finished it drops it as a late piece (worker_state.RecentBases.ended) and the
request would wait for its timeout. A process, not a replica id: a restarted replica reuses the id.
Nor to one whose max_model_len is below what the request needs at the entry stage.
"""

from __future__ import annotations

from typing import Callable, Collection

from omni import errors
from omni.config import StageConfig
from omni.errors import StageFailed, Unavailable
from omni.master.types import ReplicaInfo
from omni.orchestrator.limits import fit, fitting
from omni.orchestrator.types import PipelineRequest


def process(r: ReplicaInfo) -> tuple[str, str, int]:
    """One replica process: a replica restarted under its id is another."""
    return r.replica_id, r.host, r.pid


def awake_first(replicas: list[ReplicaInfo]) -> list[ReplicaInfo]:
    """The awake replicas, or all of them when every one sleeps."""
    return [r for r in replicas if not r.is_sleeping] or replicas


def pick(stage: StageConfig, replicas: list[ReplicaInfo], req: PipelineRequest | None, host: str | None,
         load: Callable[[ReplicaInfo], tuple], ran_on: Collection[tuple] = ()) -> ReplicaInfo:
    """A replica for `stage` out of its READY `replicas` but the processes in `ran_on`; Unavailable when
    none is (on `host`)."""
    replicas = [r for r in replicas if (host is None or r.host == host) and process(r) not in ran_on]
    if not replicas:
        raise Unavailable(f"{stage.label} has no READY replica"
                          + (f" on {host}, where its input's shared-memory tensors are" if host else "")
                          + (f" it has not already sent this request to ({', '.join(sorted({p[0] for p in ran_on}))})"
                             if ran_on else ""))
    return min(awake_first(fitting(stage, replicas, req)), key=load)


def replay_target(replicas: list[ReplicaInfo], dead: ReplicaInfo, same_host: bool,
                  load: Callable[[ReplicaInfo], tuple], ran_on: Collection[tuple] = (),
                  req: PipelineRequest | None = None, reason: str = "") -> ReplicaInfo | StageFailed | None:
    """Where a stage's part of a request moves from `dead` (on its host when `same_host`), never to
    one in `ran_on` nor to one whose limits do not take `req` (a StageFailed naming the limit when
    others are there but none does: the request was admitted by the largest one's); None: nowhere."""
    others = [r for r in replicas if r.replica_id != dead.replica_id and process(r) not in ran_on
              and (not same_host or r.host == dead.host)]
    others, why = fit(dead.stage_id, others, req)
    if why:
        return StageFailed(dead.stage_id, dead.replica_id, f"{reason}; not replayed: {why.format(which='other READY')}",
                           errors.UNAVAILABLE)
    return min(awake_first(others), key=load) if others else None
