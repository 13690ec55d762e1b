"""A replay: a stage's part of a request moves to another replica when its replica is gone, or
refused it as unavailable (draining, asleep, stopping: a state this frontend had not heard of
yet), before the stage made any output for it. Nothing of it was seen, so sending the same
inputs again, in order, is safe; later inputs follow them.

Never back to a replica process it was moved off unheard (`StageState.ran_on`): one that finished
it while this frontend could not hear it (SUSPECT, its channel closed) drops the same request id
again as a late piece (omni/stage/worker_state.RecentBases.ended), and the request would wait for
its timeout. A refusal is heard and the refuser never took the request: it may take it later
(`refused_by` only keeps two refusers from bouncing it until a move off a gone replica).
"""

from __future__ import annotations

from typing import Callable

from omni import errors
from omni.errors import StageFailed
from omni.master.types import ReplicaInfo
from omni.orchestrator import picking
from omni.orchestrator.request_state import RequestState, StageState, lost_inputs
from omni.orchestrator.topology import Topology
from omni.transport.base import SAME_HOST_ONLY


def replay_plan(state: RequestState, s: int, dead: ReplicaInfo, topology: Topology,
                load: Callable[[ReplicaInfo], tuple], reason: str,
                refused: bool = False) -> ReplicaInfo | StageFailed | None:
    """Where stage s's part of the request moves from `dead` (`refused`: it refused it): a replica, or
    a StageFailed to fail the request with now (`reason` first), or None: it cannot move (the stage
    made output, or nothing was sent, or no other READY replica is there)."""
    st = state.stages[s]
    if st.first_output_at is not None or not st.sent:
        return None
    lost = lost_inputs(s, dead.replica_id, st.sent, state.origin, topology.replicas)
    if lost is not None:     # failed now, not after the new replica's reads time out (blaming it)
        return lost
    # Shared-memory inputs need a replica on the dead one's host.
    same_host = any(ref.transport in SAME_HOST_ONLY for items in st.sent.values() for inp, _ in items
                    for ref in inp.tensors.values())
    replicas = topology.stage_replicas(s)
    not_again = st.not_again(refused)
    target = picking.replay_target(replicas, dead, same_host, load, not_again, state.req, reason)
    skipped = sorted(r.replica_id for r in replicas
                     if picking.process(r) in not_again and (not same_host or r.host == dead.host))
    if target is None and skipped:
        return StageFailed(s, dead.replica_id, f"{reason}; not replayed: the request already went to every "
                           f"other READY replica of the stage ({', '.join(skipped)})", errors.UNAVAILABLE)
    return target


def move(st: StageState, dead: ReplicaInfo, target: ReplicaInfo, refused: bool = False) -> dict[str, list]:
    """Point the stage at `target` and take back what was sent to `dead` (to send again, in order);
    `refused`: `dead` refused the request (it never ran there), else it went SUSPECT or away."""
    if refused:
        st.refused_by.add(picking.process(dead))
    else:
        st.ran_on.add(picking.process(dead))
        st.refused_by.clear()
    st.replica, st.started = target, False
    sent, st.sent = st.sent, {}
    for erid in sent:
        st.refs_in.pop(erid, None)     # recorded again as they are sent again
    return sent
