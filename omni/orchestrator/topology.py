"""The frontend's view of the master's topology, fed by WatchTopology events.

After the watch reconnects (a master restart), the new master's SNAPSHOT may come before the
stages registered with it again (their keep-alive retries with backoff): a replica missing from
it is kept as it was for `grace_s` (the lease TTL) and REMOVED only if it has not come back by
then (`expire`, which the watch loop calls when `expiry_in` says). A replica that registers again
as the same process (host, pid, endpoints) is its old self: it keeps the state it had (READY or
DRAINING, not the new lease's REGISTERING) and what this frontend holds there stays (its channel,
a started stream's next piece); another process under its id is the old one REMOVED and a new one
ADDED.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import msgspec

from omni.master.types import ReplicaInfo, TopologyEvent

logger = logging.getLogger(__name__)

LIVE = ("READY",)
GONE = ("SUSPECT", "DEAD")
SERVING = ("READY", "DRAINING")


def _restarted(before: ReplicaInfo, now: ReplicaInfo) -> bool:
    return (before.pid, before.host, before.endpoints) != (now.pid, now.host, now.endpoints)


def _as_old_self(before: ReplicaInfo | None, now: ReplicaInfo) -> ReplicaInfo:
    """`now` as this frontend sees it: the same process registering again keeps its serving state."""
    if before is not None and not _restarted(before, now) and now.state == "REGISTERING" \
            and before.state in SERVING:
        return msgspec.structs.replace(now, state=before.state)
    return now


class Topology:
    def __init__(self, grace_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas: dict[str, ReplicaInfo] = {}
        self.synced = False          # True once a snapshot arrived (stays: the last one is served from)
        self.connected = False       # the watch is up now: False while the master is away (follow_topology)
        # How long a replica missing from a snapshot is kept (the frontend sets the lease TTL).
        self.grace_s = grace_s
        self._clock = clock
        self._missing: dict[str, float] = {}     # replica id -> when it is dropped unless it came back
        self._listeners: list[Callable[[ReplicaInfo, str], None]] = []

    def on_change(self, fn: Callable[[ReplicaInfo, str], None]) -> None:
        """fn(replica, kind) after every change; kind ADDED | UPDATED | REMOVED."""
        self._listeners.append(fn)

    def apply(self, event: TopologyEvent) -> None:
        if event.kind == "SNAPSHOT":
            self._snapshot(event.replicas)
            return
        for r in event.replicas:
            self._missing.pop(r.replica_id, None)
            prev = self.replicas.get(r.replica_id)
            if event.kind == "REMOVED":
                self.replicas.pop(r.replica_id, None)
                self._notify(r, "REMOVED")
                continue
            kind = event.kind
            if prev is not None and _restarted(prev, r):      # kept through a reconnect, another process now
                self._notify(prev, "REMOVED")
                kind = "ADDED"
            elif prev is not None and kind == "ADDED":        # the same process registered again
                kind = "UPDATED"
            r = self.replicas[r.replica_id] = _as_old_self(prev, r)
            self._notify(r, kind)

    def _snapshot(self, replicas: list[ReplicaInfo]) -> None:
        old = self.replicas
        new = {r.replica_id: _as_old_self(old.get(r.replica_id), r) for r in replicas}
        self.synced = self.connected = True
        gone: list[ReplicaInfo] = []
        for rid, r in old.items():
            if rid in new:
                self._missing.pop(rid, None)
                # A replica that restarted under the same id while the watch was down is another
                # process: the old one is REMOVED (what it held fails or moves), the new one ADDED.
                if _restarted(r, new[rid]):
                    gone.append(r)
            elif self.grace_s > 0 and r.state != "DEAD":
                new[rid] = r                   # not registered again yet: kept as it was for now
                self._missing.setdefault(rid, self._clock() + self.grace_s)
            else:
                self._missing.pop(rid, None)
                gone.append(r)
        self.replicas = new
        if self._missing:
            logger.info("topology snapshot misses %s: kept for %.1f s while they register again",
                        ", ".join(sorted(self._missing)), self.grace_s)
        for r in gone:
            self._notify(r, "REMOVED")
        for r in replicas:
            prev = old.get(r.replica_id)
            self._notify(new[r.replica_id], "ADDED" if prev is not None and _restarted(prev, r) else "UPDATED")

    def expiry_in(self) -> float | None:
        """Seconds until the first replica kept through a reconnect is due to go; None: none kept."""
        if not self._missing:
            return None
        return max(0.0, min(self._missing.values()) - self._clock())

    def expire(self) -> None:
        """REMOVED: the replicas kept through a reconnect that have not come back in time."""
        now = self._clock()
        for rid, due in list(self._missing.items()):
            if due <= now:
                del self._missing[rid]
                r = self.replicas.pop(rid, None)
                if r is not None:
                    logger.warning("replica %s did not register again within %.1f s of the topology resync: "
                                   "gone", rid, self.grace_s)
                    self._notify(r, "REMOVED")

    def _notify(self, r: ReplicaInfo, kind: str) -> None:
        for fn in self._listeners:
            try:
                fn(r, kind)
            except Exception:
                logger.exception("topology listener failed")

    def stage_replicas(self, stage_id: int, states: Iterable[str] = LIVE) -> list[ReplicaInfo]:
        states = tuple(states)
        return [
            r for r in self.replicas.values()
            if r.role == "STAGE" and r.stage_id == stage_id and r.state in states
        ]

    def ready_stages(self) -> set[int]:
        return {r.stage_id for r in self.replicas.values() if r.role == "STAGE" and r.state == "READY"}
