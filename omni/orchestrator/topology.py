"""The frontend's view of the master's topology, fed by WatchTopology events."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from omni.master.types import ReplicaInfo, TopologyEvent

logger = logging.getLogger(__name__)

LIVE = ("READY",)
GONE = ("SUSPECT", "DEAD")


def _restarted(before: ReplicaInfo, now: ReplicaInfo) -> bool:
    return (before.pid, before.host, before.endpoints) != (now.pid, now.host, now.endpoints)


class Topology:
    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaInfo] = {}
        self.synced = False          # True once a snapshot arrived
        self._listeners: list[Callable[[ReplicaInfo, str], None]] = []

    def on_change(self, fn: Callable[[ReplicaInfo, str], None]) -> None:
        """fn(replica, kind) after every change; kind ADDED | UPDATED | REMOVED."""
        self._listeners.append(fn)

    def apply(self, event: TopologyEvent) -> None:
        if event.kind == "SNAPSHOT":
            old = self.replicas
            self.replicas = {r.replica_id: r for r in event.replicas}
            self.synced = True
            # A replica that restarted under the same id while the watch was down is another
            # process: the old one is REMOVED (what it held fails or moves), the new one ADDED.
            for rid, r in old.items():
                if rid not in self.replicas or _restarted(r, self.replicas[rid]):
                    self._notify(r, "REMOVED")
            for r in event.replicas:
                prev = old.get(r.replica_id)
                self._notify(r, "ADDED" if prev is not None and _restarted(prev, r) else "UPDATED")
            return
        for r in event.replicas:
            if event.kind == "REMOVED":
                self.replicas.pop(r.replica_id, None)
            else:
                self.replicas[r.replica_id] = r
            self._notify(r, event.kind)

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
