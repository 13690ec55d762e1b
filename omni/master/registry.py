"""The master's topology: replicas, their slots, leases and states. Pure: no grpc, no threads.

Every mutation returns the topology events it caused; the server publishes them to watchers.
Time comes from an injectable clock so unit tests drive leases with a fake one.

Replica states and their transitions (`TRANSITIONS`; `next_state` applies it):

    state        trigger          next state
    REGISTERING  HEARTBEAT        READY (DRAINING if the heartbeat says it is draining, or a drain is remembered)
    READY        HEARTBEAT        READY (DRAINING if the heartbeat says it is draining)
    DRAINING     HEARTBEAT        DRAINING (READY if the heartbeat says it is not draining)
    SUSPECT      HEARTBEAT        READY, or DRAINING if the heartbeat says so or a drain is remembered
    READY        DRAIN            DRAINING
    DRAINING     DRAIN            DRAINING
    REGISTERING  DRAIN            REGISTERING (remembered: the first heartbeat makes it DRAINING)
    SUSPECT      DRAIN            SUSPECT (remembered likewise)
    DRAINING     UNDRAIN          READY
    READY        UNDRAIN          READY
    REGISTERING  UNDRAIN          REGISTERING (the remembered drain is forgotten)
    SUSPECT      UNDRAIN          SUSPECT (likewise)
    REGISTERING  STREAM_BROKEN    SUSPECT
    READY        STREAM_BROKEN    SUSPECT
    DRAINING     STREAM_BROKEN    SUSPECT
    SUSPECT      STREAM_BROKEN    SUSPECT
    any live     LEASE_EXPIRED    DEAD   (no heartbeat for lease_ttl_s)
    any live     EXITED           DEAD   (the launcher that hosts the master reaped the process: `exited`)
    any          deregister       removed

Whether a replica drains is the stage's own word once it reports: a heartbeat's `draining` is taken
as it is (an UNDRAIN whose ack timed out, or that a later command superseded, no longer leaves the
replica DRAINING for good while it serves). A drain acked while the replica was REGISTERING or
SUSPECT (no heartbeat since) is remembered: its next heartbeat makes it DRAINING whatever it says,
later ones are taken as they are. A stage keeps its drain across a re-register: it reports it.
A heartbeat without a load (`no_load`: the stage could not read it) changes neither load nor drain.

A lease runs only while the master runs: when the sweeps stop for longer than `stall_after_s`
(the master was SIGSTOPped or starved), the silence was the master's, so every lease gets a
fresh TTL from the moment it runs again; a replica that is really gone is DEAD one TTL later.

DEAD is final for a lease: its heartbeats are refused (the client registers again). DEAD entries
stay listed until their slot is reused or for `dead_retention_s`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import uuid
from typing import Callable

from omni.master import configdiff, limits

logger = logging.getLogger(__name__)

NO_STAGE = -1  # stage_id of frontends


class Role(enum.Enum):
    STAGE = "STAGE"
    FRONTEND = "FRONTEND"


class ReplicaState(enum.Enum):
    REGISTERING = "REGISTERING"
    READY = "READY"
    DRAINING = "DRAINING"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"


class Trigger(enum.Enum):
    HEARTBEAT = "HEARTBEAT"
    DRAIN = "DRAIN"
    UNDRAIN = "UNDRAIN"
    STREAM_BROKEN = "STREAM_BROKEN"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    EXITED = "EXITED"   # the launcher that hosts the master reaped the process


S, T = ReplicaState, Trigger
LIVE_STATES = frozenset({S.REGISTERING, S.READY, S.DRAINING, S.SUSPECT})

TRANSITIONS: dict[tuple[ReplicaState, Trigger], ReplicaState] = {
    (S.REGISTERING, T.HEARTBEAT): S.READY,
    (S.READY, T.HEARTBEAT): S.READY,
    (S.DRAINING, T.HEARTBEAT): S.READY,
    (S.SUSPECT, T.HEARTBEAT): S.READY,
    (S.READY, T.DRAIN): S.DRAINING,
    (S.DRAINING, T.DRAIN): S.DRAINING,
    (S.REGISTERING, T.DRAIN): S.REGISTERING,
    (S.SUSPECT, T.DRAIN): S.SUSPECT,
    (S.DRAINING, T.UNDRAIN): S.READY,
    (S.READY, T.UNDRAIN): S.READY,
    (S.REGISTERING, T.UNDRAIN): S.REGISTERING,
    (S.SUSPECT, T.UNDRAIN): S.SUSPECT,
    (S.REGISTERING, T.STREAM_BROKEN): S.SUSPECT,
    (S.READY, T.STREAM_BROKEN): S.SUSPECT,
    (S.DRAINING, T.STREAM_BROKEN): S.SUSPECT,
    (S.SUSPECT, T.STREAM_BROKEN): S.SUSPECT,
    **{(state, T.LEASE_EXPIRED): S.DEAD for state in LIVE_STATES},
    **{(state, T.EXITED): S.DEAD for state in LIVE_STATES},
}


class InvalidTransition(ValueError):
    pass


class LeaseUnknown(LookupError):
    """The lease is not (or no longer) valid: the replica must register again."""


class BadRegistration(ValueError):
    """The request itself is wrong (unknown stage, missing fields)."""


class ConfigMismatch(ValueError):
    """The registrant's config hash differs from the master's; the message names the fields."""


class RegistryFull(Exception):
    """The role has as many entries (live and DEAD) as the registry holds."""


def next_state(state: ReplicaState, trigger: Trigger, draining: bool = False) -> ReplicaState:
    """Pure transition function over TRANSITIONS; `draining` turns a READY outcome into DRAINING."""
    try:
        target = TRANSITIONS[(state, trigger)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.value} on {trigger.value}") from None
    if target is S.READY and draining:
        return S.DRAINING
    return target


@dataclasses.dataclass(frozen=True)
class RegisterInput:
    role: Role
    stage_id: int
    host: str
    pid: int
    config_hash: str
    pipeline_config: dict | None = None
    replica_hint: int = -1
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    version: str = ""
    capabilities: dict[str, str] = dataclasses.field(default_factory=dict)
    instance_id: str = ""   # random per client; "" from an older one (host and pid alone then)


@dataclasses.dataclass(frozen=True)
class Load:
    queue_len: int = 0
    in_flight: int = 0
    requests_total: int = 0
    cpu_seconds: float = 0.0
    is_sleeping: bool = False
    draining: bool = False
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Replica:
    role: Role
    stage_id: int
    index: int
    replica_id: str
    lease_id: str
    host: str
    pid: int
    endpoints: dict[str, str]
    version: str
    capabilities: dict[str, str]
    registered_at: float
    last_seen: float  # last heartbeat, or registration before the first one
    state: ReplicaState = S.REGISTERING
    draining: bool = False
    load: Load = Load()
    dead_at: float | None = None
    last_event_at: float = 0.0
    load_dirty: bool = False
    instance_id: str = ""


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # ADDED | UPDATED | REMOVED
    replica: Replica  # a copy, as of `at`
    at: float


def replica_id_for(role: Role, stage_id: int, index: int) -> str:
    return f"fe{index}" if role is Role.FRONTEND else f"s{stage_id}r{index}"


class Registry:
    def __init__(
        self,
        config: dict | None = None,
        config_hash: str | None = None,
        lease_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        dead_retention_s: float = 60.0,
        load_event_interval_s: float = 0.5,
        new_lease_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        stall_after_s: float | None = None,
        max_entries_per_role: int | None = None,
    ):
        if not 0 < lease_ttl_s < float("inf"):     # inf or nan: no lease would ever expire
            raise ValueError(f"lease_ttl_s must be > 0 and finite, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        # A gap between two sweeps longer than this is a master stall (None: never; the
        # server sweeps on a timer and sets it, unit tests that sweep by hand need not).
        self._stall_after_s = stall_after_s
        self._last_sweep: float | None = None
        self._grace_from = float("-inf")   # leases count from here at the earliest
        self._clock = clock
        self._dead_retention_s = dead_retention_s
        self._load_interval = load_event_interval_s
        self._new_lease_id = new_lease_id
        self._config: dict | None = None
        self._config_hash = ""
        self._stages: dict[int, dict] = {}
        if config is not None:
            self._adopt(config, config_hash or configdiff.hash_config(config))
        self._by_lease: dict[str, Replica] = {}
        self._slots: dict[tuple[Role, int, int], str] = {}
        self._max_per_role = max_entries_per_role or limits.MAX_ENTRIES_PER_ROLE

    # -- config -----------------------------------------------------------------------------
    def _adopt(self, config: dict, config_hash: str) -> None:
        try:
            stages = configdiff.stages_by_id(config)
        except ValueError as e:
            raise BadRegistration(str(e)) from None
        self._config, self._config_hash, self._stages = config, config_hash, stages

    @property
    def config(self) -> dict | None:
        return self._config

    @property
    def config_hash(self) -> str:
        return self._config_hash

    def stage_ids(self) -> list[int]:
        return sorted(self._stages)

    def stage_config(self, stage_id: int) -> dict:
        return self._stages.get(stage_id, {})

    # -- queries ----------------------------------------------------------------------------
    def lookup(self, lease_id: str) -> Replica | None:
        return self._by_lease.get(lease_id)

    def live(self, lease_id: str) -> Replica:
        rep = self._by_lease.get(lease_id)
        if rep is None or rep.state is S.DEAD:
            raise LeaseUnknown(f"lease {lease_id[:12]!r} is unknown or expired; register again")
        return rep

    def by_replica_id(self, replica_id: str) -> Replica | None:
        for rep in self._by_lease.values():
            if rep.replica_id == replica_id:
                return rep
        return None

    def replicas(self) -> list[Replica]:
        order = {Role.STAGE: 0, Role.FRONTEND: 1}
        return sorted(self._by_lease.values(), key=lambda r: (order[r.role], r.stage_id, r.index))

    def heartbeat_age(self, rep: Replica) -> float:
        return max(0.0, self._clock() - rep.last_seen)

    def stage_counts(self) -> list[tuple[int, int, int]]:
        """(stage_id, READY replicas, live replicas) for every stage of the pipeline."""
        out = []
        for sid in self.stage_ids():
            reps = [r for r in self._by_lease.values() if r.role is Role.STAGE and r.stage_id == sid]
            ready = sum(r.state is S.READY for r in reps)
            live = sum(r.state in LIVE_STATES for r in reps)
            out.append((sid, ready, live))
        return out

    # -- mutations --------------------------------------------------------------------------
    def register(self, req: RegisterInput) -> tuple[Replica, list[Event]]:
        if not req.host:
            raise BadRegistration("host is required")
        if not req.config_hash:
            raise BadRegistration("config_hash is required")
        stage_id = req.stage_id if req.role is Role.STAGE else NO_STAGE
        if self._config is None:
            if req.pipeline_config is None:
                raise BadRegistration("the master has no pipeline config yet and the registrant sent none")
            self._adopt(req.pipeline_config, req.config_hash)
            logger.info("adopted the pipeline config of the first registrant (hash %s)", req.config_hash[:12])
        elif req.config_hash != self._config_hash:
            raise ConfigMismatch(configdiff.mismatch_message(
                self._config, req.pipeline_config, stage_id if req.role is Role.STAGE else None,
                self._config_hash, req.config_hash))
        if req.role is Role.STAGE and stage_id not in self._stages:
            known = ", ".join(map(str, self.stage_ids()))
            raise BadRegistration(f"stage {stage_id} is not in the pipeline (stages: {known})")

        now = self._clock()
        events: list[Event] = []
        index = self._pick_index(req.role, stage_id, req.replica_hint, (req.host, req.pid, req.instance_id))
        old_lease = self._slots.get((req.role, stage_id, index))
        if old_lease is None and sum(r.role is req.role for r in self._by_lease.values()) >= self._max_per_role:
            raise RegistryFull(f"the master holds {self._max_per_role} {req.role.value} entries (live and DEAD), "
                               f"its limit; a DEAD one is forgotten {self._dead_retention_s:g} s after it died")
        if old_lease is not None:
            old = self._by_lease.pop(old_lease)
            events.append(self._event("REMOVED", old, now))
        rep = Replica(
            role=req.role, stage_id=stage_id, index=index,
            replica_id=replica_id_for(req.role, stage_id, index), lease_id=self._new_lease_id(),
            host=req.host, pid=req.pid, endpoints=dict(req.endpoints), version=req.version,
            capabilities=dict(req.capabilities), registered_at=now, last_seen=now, instance_id=req.instance_id,
        )
        self._by_lease[rep.lease_id] = rep
        self._slots[(req.role, stage_id, index)] = rep.lease_id
        events.append(self._event("ADDED", rep, now))
        return rep, events

    def _pick_index(self, role: Role, stage_id: int, hint: int, process: tuple[str, int, str]) -> int:
        def reusable(i: int, same_process_ok: bool) -> bool:
            lease = self._slots.get((role, stage_id, i))
            if lease is None:
                return True
            holder = self._by_lease[lease]
            if holder.state is S.DEAD:
                return True
            # A process registering again (its old lease lost) replaces its own stale entry. Host and pid alone
            # are not one process: two containers on a host share its address and often their pids.
            return same_process_ok and (holder.host, holder.pid, holder.instance_id) == process

        if hint >= 0 and reusable(hint, same_process_ok=True):
            return hint
        i = 0
        while not reusable(i, same_process_ok=False):
            i += 1
        return i

    def heartbeat(self, lease_id: str, load: Load | None) -> list[Event]:
        """`load` None: the stage sent none (it could not read it); its last load and drain stand."""
        rep = self.live(lease_id)
        now = self._clock()
        rep.last_seen = now
        if load is None:
            load = rep.load
        else:   # the stage's word, except a drain remembered while it had not reported (REGISTERING, SUSPECT)
            rep.draining = load.draining or (rep.draining and rep.state in (S.REGISTERING, S.SUSPECT))
        old_state, old_load = rep.state, rep.load
        rep.state = next_state(rep.state, T.HEARTBEAT, rep.draining)
        rep.load = load
        if rep.state is not old_state or load.is_sleeping != old_load.is_sleeping:
            return [self._event("UPDATED", rep, now)]
        if load != old_load:
            if now - rep.last_event_at >= self._load_interval:
                return [self._event("UPDATED", rep, now)]
            rep.load_dirty = True
        return []

    def stream_broken(self, lease_id: str) -> list[Event]:
        rep = self._by_lease.get(lease_id)
        if rep is None or rep.state is S.DEAD:
            return []
        return self._apply(rep, T.STREAM_BROKEN)

    def drain(self, replica_id: str) -> list[Event]:
        rep = self.by_replica_id(replica_id)
        if rep is None or rep.state is S.DEAD:
            return []
        was_draining, rep.draining = rep.draining, True
        events = self._apply(rep, T.DRAIN)
        if not events and not was_draining:  # state kept (REGISTERING/SUSPECT) but the flag is news
            events = [self._event("UPDATED", rep, self._clock())]
        return events

    def undrain(self, replica_id: str) -> list[Event]:
        rep = self.by_replica_id(replica_id)
        if rep is None or rep.state is S.DEAD:
            return []
        was_draining, rep.draining = rep.draining, False
        events = self._apply(rep, T.UNDRAIN)
        if not events and was_draining:
            events = [self._event("UPDATED", rep, self._clock())]
        return events

    def last_serving(self, replica_ids: set[str]) -> dict[int, list[str]]:
        """Stages that would have no READY, awake replica left without `replica_ids`:
        {stage_id: those of its serving replicas that are in replica_ids}."""
        out: dict[int, list[str]] = {}
        for sid in self.stage_ids():
            serving = [r.replica_id for r in self._by_lease.values() if r.role is Role.STAGE
                       and r.stage_id == sid and r.state is S.READY and not r.load.is_sleeping]
            if serving and all(rid in replica_ids for rid in serving):
                out[sid] = serving
        return out

    def exited(self, role: Role, host: str, pid: int, instance_id: str = "") -> list[Event]:
        """The process is known to be gone (its launcher reaped it): its live entries are DEAD now, not a lease
        TTL later, so their index is free for the process that replaces it. Host and pid alone are not one
        process (two containers on a host address often share pids): `instance_id`, the one its launcher gave
        it, picks its entries; "" (not known) marks none where entries of several processes match."""
        reps = [rep for rep in self._by_lease.values()
                if rep.role is role and (rep.host, rep.pid) == (host, pid) and rep.state in LIVE_STATES]
        if instance_id:
            reps = [rep for rep in reps if rep.instance_id == instance_id]
        elif len({rep.instance_id for rep in reps}) > 1:
            logger.warning("pid %d on %s exited: %d processes registered under that host and pid, none marked "
                           "(their leases expire them)", pid, host, len(reps))
            return []
        events: list[Event] = []
        for rep in reps:
            events += self._mark_dead(rep, T.EXITED)
        return events

    def deregister(self, lease_id: str) -> tuple[bool, list[Event]]:
        rep = self._by_lease.pop(lease_id, None)
        if rep is None:
            return False, []
        self._slots.pop((rep.role, rep.stage_id, rep.index), None)
        return True, [self._event("REMOVED", rep, self._clock())]

    def sweep(self) -> list[Event]:
        """Expire leases, forget old DEAD entries, flush throttled load updates."""
        now = self._clock()
        if (self._stall_after_s is not None and self._last_sweep is not None
                and now - self._last_sweep > self._stall_after_s):
            logger.warning("the master itself did not run for %.1f s (stopped or starved): every lease "
                           "gets a fresh %.1f s before anyone is declared dead", now - self._last_sweep,
                           self.lease_ttl_s)
            self._grace_from = now
        self._last_sweep = now
        events: list[Event] = []
        for rep in list(self._by_lease.values()):
            if rep.state in LIVE_STATES and now - max(rep.last_seen, self._grace_from) > self.lease_ttl_s:
                logger.warning("replica %s (pid %d on %s): no heartbeat for %.1f s, lease expired",
                               rep.replica_id, rep.pid, rep.host, now - rep.last_seen)
                events += self._mark_dead(rep, T.LEASE_EXPIRED)
            elif rep.state is S.DEAD and rep.dead_at is not None and now - rep.dead_at >= self._dead_retention_s:
                _, removed = self.deregister(rep.lease_id)
                events += removed
            elif rep.load_dirty and now - rep.last_event_at >= self._load_interval:
                events.append(self._event("UPDATED", rep, now))
        return events

    # -- helpers ----------------------------------------------------------------------------
    def _mark_dead(self, rep: Replica, trigger: Trigger) -> list[Event]:
        """A live replica is DEAD: kept listed `dead_retention_s` from now, its slot free for the next one."""
        rep.dead_at = self._clock()
        return self._apply(rep, trigger)

    def _apply(self, rep: Replica, trigger: Trigger) -> list[Event]:
        new = next_state(rep.state, trigger, rep.draining)
        if new is rep.state:
            return []
        logger.info("replica %s: %s -> %s (%s)", rep.replica_id, rep.state.value, new.value, trigger.value)
        rep.state = new
        return [self._event("UPDATED", rep, self._clock())]

    def _event(self, kind: str, rep: Replica, now: float) -> Event:
        rep.last_event_at = now
        rep.load_dirty = False
        return Event(kind=kind, replica=dataclasses.replace(rep), at=now)
