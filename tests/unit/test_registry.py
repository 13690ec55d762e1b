"""The master's registry as a pure state machine, driven by a fake clock."""

import itertools

import pytest

from omni.master import configdiff
from omni.master.registry import (
    TRANSITIONS,
    BadRegistration,
    ConfigMismatch,
    InvalidTransition,
    LeaseUnknown,
    Load,
    RegisterInput,
    Registry,
    ReplicaState as S,
    Role,
    Trigger as T,
    next_state,
)

CONFIG = {
    "model": "tiny",
    "stages": [
        {"stage_id": 0, "engine_args": {"max_model_len": 2048}},
        {"stage_id": 1, "engine_args": {"max_model_len": 2048, "dtype": "bf16"}},
    ],
}
HASH = configdiff.hash_config(CONFIG)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, dt):
        self.now += dt


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def reg(clock):
    counter = itertools.count()
    return Registry(CONFIG, HASH, lease_ttl_s=5.0, clock=clock, dead_retention_s=60.0,
                    new_lease_id=lambda: f"lease{next(counter)}")


def stage(stage_id=1, pid=100, hint=-1, host="h1", config=None):
    cfg = CONFIG if config is None else config
    return RegisterInput(role=Role.STAGE, stage_id=stage_id, host=host, pid=pid, replica_hint=hint,
                         config_hash=configdiff.hash_config(cfg), pipeline_config=cfg,
                         endpoints={"channel": f"tcp://127.0.0.1:{5000 + pid}"})


def kinds(events):
    return [(e.kind, e.replica.replica_id, e.replica.state) for e in events]


# -- the transition table -------------------------------------------------------------------

@pytest.mark.parametrize("state,trigger,draining,expected", [
    (S.REGISTERING, T.HEARTBEAT, False, S.READY),
    (S.REGISTERING, T.HEARTBEAT, True, S.DRAINING),
    (S.READY, T.HEARTBEAT, False, S.READY),
    (S.READY, T.HEARTBEAT, True, S.DRAINING),
    (S.READY, T.DRAIN, True, S.DRAINING),
    (S.SUSPECT, T.HEARTBEAT, False, S.READY),
    (S.SUSPECT, T.HEARTBEAT, True, S.DRAINING),
    (S.READY, T.STREAM_BROKEN, False, S.SUSPECT),
    (S.DRAINING, T.STREAM_BROKEN, True, S.SUSPECT),
    (S.REGISTERING, T.STREAM_BROKEN, False, S.SUSPECT),
    (S.SUSPECT, T.LEASE_EXPIRED, False, S.DEAD),
    (S.READY, T.LEASE_EXPIRED, False, S.DEAD),
    (S.DRAINING, T.LEASE_EXPIRED, True, S.DEAD),
    (S.REGISTERING, T.LEASE_EXPIRED, False, S.DEAD),
])
def test_next_state(state, trigger, draining, expected):
    assert next_state(state, trigger, draining) is expected


def test_dead_is_final():
    for trigger in T:
        with pytest.raises(InvalidTransition, match="DEAD"):
            next_state(S.DEAD, trigger)
    assert not any(state is S.DEAD for state, _ in TRANSITIONS)


# -- registration, slots, config ------------------------------------------------------------

def test_register_assigns_lowest_free_index_and_ids(reg):
    a, ev = reg.register(stage(pid=1))
    b, _ = reg.register(stage(pid=2))
    fe, _ = reg.register(RegisterInput(role=Role.FRONTEND, stage_id=7, host="h", pid=3, config_hash=HASH))
    assert (a.replica_id, a.index, b.replica_id, fe.replica_id, fe.stage_id) == ("s1r0", 0, "s1r1", "fe0", -1)
    assert kinds(ev) == [("ADDED", "s1r0", S.REGISTERING)]
    reg.deregister(a.lease_id)
    c, _ = reg.register(stage(pid=4))
    assert c.index == 0  # the freed slot is the lowest


def test_first_heartbeat_makes_ready_and_emits_update(reg):
    a, _ = reg.register(stage())
    ev = reg.heartbeat(a.lease_id, Load(queue_len=1))
    assert kinds(ev) == [("UPDATED", "s1r0", S.READY)]
    assert reg.stage_counts() == [(0, 0, 0), (1, 1, 1)]


def test_load_updates_are_throttled_then_flushed_by_sweep(reg, clock):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    clock.advance(0.1)
    assert reg.heartbeat(a.lease_id, Load(queue_len=3)) == []  # within 0.5 s of the last event
    assert reg.sweep() == []
    clock.advance(0.5)
    ev = reg.sweep()
    assert [e.replica.load.queue_len for e in ev] == [3]
    clock.advance(0.6)
    assert [e.replica.load.queue_len for e in reg.heartbeat(a.lease_id, Load(queue_len=4))] == [4]
    # Sleeping is state-like: reported at once.
    assert reg.heartbeat(a.lease_id, Load(queue_len=4, is_sleeping=True))[0].replica.load.is_sleeping


def test_stream_broken_suspect_then_resume(reg, clock):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    assert kinds(reg.stream_broken(a.lease_id)) == [("UPDATED", "s1r0", S.SUSPECT)]
    assert reg.stream_broken(a.lease_id) == []  # idempotent
    assert kinds(reg.heartbeat(a.lease_id, Load())) == [("UPDATED", "s1r0", S.READY)]


def test_drain_survives_suspect(reg):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    assert kinds(reg.drain("s1r0")) == [("UPDATED", "s1r0", S.DRAINING)]
    reg.stream_broken(a.lease_id)
    assert kinds(reg.heartbeat(a.lease_id, Load())) == [("UPDATED", "s1r0", S.DRAINING)]
    assert reg.stage_counts()[1] == (1, 0, 1)  # draining is live, not ready


def test_drain_while_registering_is_remembered(reg):
    a, _ = reg.register(stage())
    assert kinds(reg.drain("s1r0")) == [("UPDATED", "s1r0", S.REGISTERING)]
    assert reg.lookup(a.lease_id).draining
    assert reg.heartbeat(a.lease_id, Load())[0].replica.state is S.DRAINING


def test_replica_reported_drain(reg):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    assert kinds(reg.heartbeat(a.lease_id, Load(draining=True))) == [("UPDATED", "s1r0", S.DRAINING)]


def test_a_heartbeat_without_a_load_keeps_the_last_one_and_the_drain(reg):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load(draining=True, is_sleeping=True, requests_total=5))
    assert reg.heartbeat(a.lease_id, None) == []   # no_load: nothing changed, nothing to tell the frontends
    rep = reg.lookup(a.lease_id)
    assert (rep.state, rep.draining, rep.load.is_sleeping, rep.load.requests_total) == (S.DRAINING, True, True, 5)
    b, _ = reg.register(stage(pid=101))
    reg.drain(b.replica_id)                        # remembered while REGISTERING
    reg.heartbeat(b.lease_id, None)
    assert reg.heartbeat(b.lease_id, None) == [] and reg.lookup(b.lease_id).state is S.DRAINING


def test_lease_expiry_dead_then_forgotten(reg, clock):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    reg.stream_broken(a.lease_id)
    clock.advance(4.9)
    assert reg.sweep() == []
    clock.advance(0.2)
    assert kinds(reg.sweep()) == [("UPDATED", "s1r0", S.DEAD)]
    with pytest.raises(LeaseUnknown, match="register again"):
        reg.heartbeat(a.lease_id, Load())
    assert [r.replica_id for r in reg.replicas()] == ["s1r0"]  # still listed for status
    clock.advance(59.8)
    assert reg.sweep() == []
    clock.advance(0.3)
    assert kinds(reg.sweep()) == [("REMOVED", "s1r0", S.DEAD)]
    assert reg.replicas() == []


def test_registering_without_heartbeat_expires(reg, clock):
    reg.register(stage())
    clock.advance(5.1)
    assert kinds(reg.sweep()) == [("UPDATED", "s1r0", S.DEAD)]


def test_hint_reuses_dead_slot_and_replaces_entry(reg, clock):
    a, _ = reg.register(stage(pid=1))
    b, _ = reg.register(stage(pid=2))
    reg.heartbeat(b.lease_id, Load())
    clock.advance(6)
    reg.sweep()  # both DEAD
    c, ev = reg.register(stage(pid=9, hint=1))
    assert c.replica_id == "s1r1"
    assert kinds(ev) == [("REMOVED", "s1r1", S.DEAD), ("ADDED", "s1r1", S.REGISTERING)]
    d, _ = reg.register(stage(pid=10))  # no hint: lowest reusable slot is the dead r0
    assert d.replica_id == "s1r0"
    assert len(reg.replicas()) == 2


def test_hint_refused_when_slot_held_by_another_live_process(reg):
    a, _ = reg.register(stage(pid=1))
    reg.heartbeat(a.lease_id, Load())
    reg.stream_broken(a.lease_id)  # SUSPECT, but a different process asks for its slot
    b, _ = reg.register(stage(pid=2, hint=0))
    assert b.replica_id == "s1r1"


def test_hint_granted_to_same_process_over_suspect_entry(reg):
    a, _ = reg.register(stage(pid=1))
    reg.stream_broken(a.lease_id)
    b, ev = reg.register(stage(pid=1, hint=0))
    assert b.replica_id == "s1r0" and b.lease_id != a.lease_id
    assert reg.lookup(a.lease_id) is None
    assert [e.kind for e in ev] == ["REMOVED", "ADDED"]


def test_hint_on_free_slot_after_master_restart(reg):
    a, _ = reg.register(stage(pid=1, hint=3))
    assert a.replica_id == "s1r3"
    b, _ = reg.register(stage(pid=2))
    assert b.index == 0


def test_deregister(reg):
    a, _ = reg.register(stage())
    removed, ev = reg.deregister(a.lease_id)
    assert removed and kinds(ev) == [("REMOVED", "s1r0", S.REGISTERING)]
    assert reg.deregister(a.lease_id) == (False, [])


def test_config_mismatch_names_fields(reg):
    other = {**CONFIG, "stages": [CONFIG["stages"][0],
                                  {"stage_id": 1, "engine_args": {"max_model_len": 1024, "dtype": "bf16"}}]}
    with pytest.raises(ConfigMismatch) as e:
        reg.register(stage(config=other))
    assert str(e.value) == ("stage 1 config differs from the master's: "
                            "engine_args.max_model_len: master=2048 replica=1024")


def test_unknown_stage_and_missing_fields(reg):
    with pytest.raises(BadRegistration, match=r"stage 5 is not in the pipeline \(stages: 0, 1\)"):
        reg.register(stage(stage_id=5))
    with pytest.raises(BadRegistration, match="config_hash is required"):
        reg.register(RegisterInput(role=Role.STAGE, stage_id=0, host="h", pid=1, config_hash=""))


def test_adopts_first_registrant_config(clock):
    reg = Registry(clock=clock)
    assert reg.config is None and reg.stage_counts() == []
    with pytest.raises(BadRegistration, match="sent none"):
        reg.register(RegisterInput(role=Role.STAGE, stage_id=0, host="h", pid=1, config_hash="x"))
    reg.register(stage(stage_id=0))
    assert reg.config_hash == HASH and reg.stage_ids() == [0, 1]
    with pytest.raises(ConfigMismatch, match="model: master=\"tiny\" replica=\"big\""):
        reg.register(stage(config={**CONFIG, "model": "big"}))


def test_bad_config_rejected_at_construction():
    with pytest.raises(BadRegistration, match="no 'stages' list"):
        Registry({"model": "x"})


# -- the config diff (pure) -----------------------------------------------------------------

def test_diff_values_recursive():
    m = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "e": None}
    r = {"a": 1, "b": {"c": [1, 3], "f": True}, "e": None}
    assert configdiff.diff_values(m, r) == [
        "b.c[1]: master=2 replica=3",
        'b.d: master="x" replica=<missing>',
        "b.f: master=<missing> replica=true",
    ]
    assert configdiff.diff_values({"l": [1]}, {"l": [1, 2]}) == ["l: master=[1] replica=[1, 2]"]


def test_diff_pipeline_orders_own_stage_first():
    other = {"model": "big", "stages": [{"stage_id": 0, "x": 2}, {"stage_id": 1, "y": 1}]}
    base = {"model": "tiny", "stages": [{"stage_id": 0, "x": 1}, {"stage_id": 1, "y": 0}]}
    assert configdiff.diff_pipeline(base, other, 1) == [
        "y: master=0 replica=1", "stage 0: x: master=1 replica=2", 'model: master="tiny" replica="big"']


def test_mismatch_message_never_shows_a_stages_env_values():
    """Users put HF_TOKEN and the like in a stage's env: the refusal names a variable set on one side only,
    never a value, and does not compare the values either."""
    master = {"model": "m", "stages": [{"stage_id": 0, "env": {"HF_TOKEN": "hf_aa", "SAME": "s1"}},
                                       {"stage_id": 1, "env": {"KEY": "v1"}}]}
    replica = {"model": "m", "stages": [{"stage_id": 0, "env": {"HF_TOKEN": "hf_bb", "SAME": "s1", "NEW": "v2"}}]}
    text = configdiff.mismatch_message(master, replica, 0, "a", "b")
    assert "HF_TOKEN" not in text
    assert 'env.NEW: master=<missing> replica="***"' in text
    assert 'stage 1: <root>: master={"env": {"KEY": "***"}, "stage_id": 1} replica=<missing>' in text
    assert not any(v in text for v in ("hf_aa", "hf_bb", "s1", "v1", "v2")), text
    assert "the parts compared here are equal" in configdiff.mismatch_message(master, master, 0, "a", "b")


def test_a_guess_of_a_hidden_value_is_not_confirmed():
    """A registrant (on a master without a token) sees the master's config with env values and hf_token
    masked; the refusal for a wrong guess of one is the refusal for the right guess, so it confirms none."""
    master = {"model": "m", "stages": [{"stage_id": 0, "env": {"PIN": "4821"}, "engine_args": {"hf_token": "hf_a"}}]}

    def refusal(pin: str, token: str) -> str:
        guess = {"model": "m", "stages": [{"stage_id": 0, "env": {"PIN": pin}, "engine_args": {"hf_token": token}}]}
        return configdiff.mismatch_message(master, guess, 0, "a" * 16, "x" * 16)
    assert refusal("0000", "hf_a") == refusal("4821", "hf_a") == refusal("4821", "hf_b") == refusal("0000", "hf_b")
    assert "env values and engine_args.hf_token are not compared here" in refusal("0000", "hf_a")


def test_mismatch_message_edge_cases():
    assert "sent no pipeline_config_json" in configdiff.mismatch_message(CONFIG, None, 0, "a" * 64, "b" * 64)
    assert "the parts compared here are equal" in configdiff.mismatch_message(CONFIG, CONFIG, None, "a", "b")
    assert configdiff.mismatch_message(CONFIG, {**CONFIG, "m": 1}, None, "a", "b").startswith("frontend config")


def sweeping(clock, reg, seconds, tick=0.25):
    """Run the sweeper as the server does: every `tick` seconds for `seconds`; the events it made."""
    events = []
    for _ in range(round(seconds / tick)):
        clock.advance(tick)
        events += reg.sweep()
    return events


def test_a_stalled_master_gives_every_lease_a_fresh_ttl(clock):
    reg = Registry(CONFIG, HASH, lease_ttl_s=5.0, clock=clock, stall_after_s=2.5)
    a, _ = reg.register(stage(pid=1))
    b, _ = reg.register(stage(pid=2))
    for r in (a, b):
        reg.heartbeat(r.lease_id, Load())
    assert sweeping(clock, reg, 1.0) == []
    # The master stops for 4 TTLs (SIGSTOP): no sweep, no heartbeat processed meanwhile.
    clock.advance(20.0)
    assert reg.sweep() == []            # its own silence, not theirs
    # a's heartbeats (queued while the master was stopped) arrive; b is really gone.
    reg.heartbeat(a.lease_id, Load())
    events = []
    for _ in range(40):                  # 10 s of sweeps at 0.25 s, a heartbeating every second
        clock.advance(0.25)
        if clock.now % 1.0 == 0:
            reg.heartbeat(a.lease_id, Load())
        events += [(e.at, e.replica.replica_id, e.replica.state) for e in reg.sweep()]
    resumed = 1000.0 + 1.0 + 20.0
    assert [(rid, st) for _, rid, st in events] == [("s1r1", S.DEAD)]
    # DEAD one TTL after the master ran again (to the sweep tick), not before.
    assert 5.0 < events[0][0] - resumed <= 5.25
    assert reg.live(a.lease_id).state is S.READY


def test_sweeps_on_time_do_not_extend_leases(clock):
    reg = Registry(CONFIG, HASH, lease_ttl_s=5.0, clock=clock, stall_after_s=2.5)
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    events = sweeping(clock, reg, 5.5)
    assert kinds(events) == [("UPDATED", "s1r0", S.DEAD)]
    # A stall shorter than stall_after_s changes nothing either: expiry stays at last_seen + TTL.
    b, _ = reg.register(stage(pid=2))
    reg.heartbeat(b.lease_id, Load())
    clock.advance(2.0)
    assert reg.sweep() == []
    clock.advance(2.0)
    assert reg.sweep() == []
    clock.advance(1.25)



def test_undrain_takes_a_draining_replica_back(reg):
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    reg.drain("s1r0")
    assert kinds(reg.undrain("s1r0")) == [("UPDATED", "s1r0", S.READY)]
    assert kinds(reg.heartbeat(a.lease_id, Load())) == []          # stays READY
    assert reg.undrain("s1r0") == []                                  # nothing to take back
    b, _ = reg.register(stage(pid=2))
    reg.drain(b.replica_id)                                           # remembered while REGISTERING ...
    reg.undrain(b.replica_id)                                         # ... and forgotten
    assert kinds(reg.heartbeat(b.lease_id, Load())) == [("UPDATED", "s1r1", S.READY)]


def test_a_drained_replica_whose_heartbeat_says_it_serves_is_ready_again(reg):
    """An UNDRAIN whose ack timed out (or that a later command superseded) marked nothing here, but
    the stage serves again: its heartbeats say so, and they are taken as they are."""
    a, _ = reg.register(stage())
    reg.heartbeat(a.lease_id, Load())
    reg.drain("s1r0")                                                  # the DRAIN's ack
    assert reg.heartbeat(a.lease_id, Load(draining=True)) == []        # the stage drains: stays DRAINING
    assert kinds(reg.heartbeat(a.lease_id, Load())) == [("UPDATED", "s1r0", S.READY)]
    assert not reg.lookup(a.lease_id).draining and reg.stage_counts()[1] == (1, 1, 1)
    # A drain remembered while REGISTERING holds at its first heartbeat only.
    b, _ = reg.register(stage(pid=2))
    reg.drain(b.replica_id)
    assert kinds(reg.heartbeat(b.lease_id, Load())) == [("UPDATED", "s1r1", S.DRAINING)]
    assert kinds(reg.heartbeat(b.lease_id, Load())) == [("UPDATED", "s1r1", S.READY)]


def test_a_drain_sticks_across_the_stages_re_register(reg, clock):
    a, _ = reg.register(stage(pid=7))
    reg.heartbeat(a.lease_id, Load())
    reg.drain("s1r0")
    reg.heartbeat(a.lease_id, Load(draining=True))
    again, _ = reg.register(stage(pid=7, hint=0))                      # its lease lost: the same process again
    assert again.replica_id == "s1r0" and again.state is S.REGISTERING
    assert kinds(reg.heartbeat(again.lease_id, Load(draining=True))) == [("UPDATED", "s1r0", S.DRAINING)]
    clock.advance(1.0)
    assert reg.heartbeat(again.lease_id, Load(draining=True)) == [] and reg.lookup(again.lease_id).draining


def test_last_serving_names_the_stages_a_command_would_stop(reg):
    a, _ = reg.register(stage(stage_id=0, pid=1))
    b, _ = reg.register(stage(stage_id=1, pid=2))
    c, _ = reg.register(stage(stage_id=1, pid=3))
    for r in (a, b, c):
        reg.heartbeat(r.lease_id, Load())
    assert reg.last_serving({"s1r0"}) == {}                           # s1r1 still serves stage 1
    assert reg.last_serving({"s0r0", "s1r0"}) == {0: ["s0r0"]}
    reg.heartbeat(c.lease_id, Load(is_sleeping=True))                 # asleep: serves nothing
    assert reg.last_serving({"s1r0"}) == {1: ["s1r0"]}


def test_exited_marks_only_that_processes_live_frontend_dead(reg):
    fe, _ = reg.register(RegisterInput(role=Role.FRONTEND, stage_id=-1, host="h1", pid=7, config_hash=HASH))
    other, _ = reg.register(RegisterInput(role=Role.FRONTEND, stage_id=-1, host="h2", pid=7, config_hash=HASH))
    st, _ = reg.register(stage(pid=7))
    assert kinds(reg.exited(Role.FRONTEND, "h1", 7)) == [("UPDATED", "fe0", S.DEAD)]
    assert (other.state, st.state) == (S.REGISTERING, S.REGISTERING)
    assert reg.exited(Role.FRONTEND, "h1", 7) == []      # DEAD is final
    again, _ = reg.register(RegisterInput(role=Role.FRONTEND, stage_id=-1, host="h1", pid=8, config_hash=HASH,
                                          replica_hint=0))
    assert again.replica_id == "fe0"


def test_the_module_docstring_lists_every_transition():
    """The table in registry.py's docstring lacked `any live -EXITED-> DEAD`."""
    import re

    from omni.master import registry

    rows = re.findall(r"^ {4}(any live|[A-Z]+) +([A-Z_]+) +([A-Z]+)", registry.__doc__, re.M)
    for (state, trigger), target in registry.TRANSITIONS.items():
        # a READY outcome is DRAINING for a draining replica (next_state); the table may name either first
        targets = {target.value, "DRAINING"} if target is registry.S.READY else {target.value}
        assert any(t == trigger.value and n in targets
                   and (s == state.value or (s == "any live" and state in registry.LIVE_STATES))
                   for s, t, n in rows), f"{state.value} {trigger.value} -> {target.value} is not in the docstring"
