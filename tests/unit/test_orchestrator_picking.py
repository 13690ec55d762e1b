"""Replica picking: a sleeping replica takes no new request and no replay while an awake one is
there (it would answer 'asleep' and, reporting no load, be the least loaded), and is picked only
when none is awake, so the client gets its 'asleep' 503. A pick that went to sleep (or draining)
before the stage's first input reached it is picked again, or moved when it refuses that input."""

from __future__ import annotations

import msgspec

from omni import errors
from omni.master.types import TopologyEvent
from omni.orchestrator import events as ev
from omni.stage import messages as m
from tests.unit.test_orchestrator_core import chat, ids, make_core, of, output, ref, replica, sends


def asleep(r):
    return msgspec.structs.replace(r, is_sleeping=True)


def test_new_requests_go_to_an_awake_replica_even_a_busier_one_and_to_a_sleeping_one_only_if_none_is_awake():
    busy = msgspec.structs.replace(replica(0, "s0r1"), in_flight=5)
    core = make_core(asleep(replica(0, "s0r0")), busy, replica(1, "s1r0"), replica(2, "s2r0"))
    assert sends(core.submit(chat("r1", modalities=("text",)))) == [("s0r1", "r1", True)]
    assert sends(core.submit(chat("r2", modalities=("text",)))) == [("s0r1", "r2", True)]
    core.topology.apply(TopologyEvent("UPDATED", [asleep(busy)], 2))
    assert sends(core.submit(chat("r3", modalities=("text",)))) == [("s0r0", "r3", True)]   # least loaded of all


def test_a_replay_goes_to_an_awake_replica_and_to_a_sleeping_one_only_if_none_is_awake():
    busy = msgspec.structs.replace(replica(0, "s0r2"), in_flight=5)
    for others, expect in (((asleep(replica(0, "s0r1")), busy), "s0r2"), ((asleep(replica(0, "s0r1")),), "s0r1")):
        core = make_core(replica(0, "s0r0"), *others, replica(1, "s1r0"), replica(2, "s2r0"))
        assert sends(core.submit(chat(modalities=("text",)))) == [("s0r0", "r1", True)]
        dead = replica(0, "s0r0", state="SUSPECT")
        core.topology.apply(TopologyEvent("UPDATED", [dead], 2))
        assert sends(core.handle(ev.ReplicaGone(dead, "suspect"))) == [(expect, "r1", True)]


def test_a_downstream_pick_that_went_to_sleep_before_its_first_input_is_picked_again():
    """The talker is picked at admission; it is put to sleep before the thinker's first sentence
    reaches it: that sentence goes to the awake replica (it went to the sleeping one, whose 'asleep'
    failed the request with 503), as a DRAINING pick's does."""
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(1, "s1r1"), replica(2, "s2r0"))
    core.submit(chat())
    assert core.requests["r1"].stages[1].replica.replica_id == "s1r0"
    core.topology.apply(TopologyEvent("UPDATED", [asleep(replica(1, "s1r0"))], 2))
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("Hello there. ")))
    assert sends(acts) == [("s1r1", "r1/s1", True)]
    assert "r1" not in core.by_replica.get("s1r0", ())      # its load moved with it


def test_a_stage_whose_first_input_is_refused_as_unavailable_moves_to_another_replica():
    """A replica turned draining (or asleep) after this frontend's last topology event refuses the
    stage's first input: nothing of it was produced, so it goes to another READY replica (it failed
    the request with 503); with no other replica, the refusal's 503 reaches the client."""
    for how in ("draining; `omni undrain --replica s1r0` takes it back", "asleep; `omni wakeup --stage 1` wakes it"):
        core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(1, "s1r1"), replica(2, "s2r0"))
        core.submit(chat())
        core.handle(output("s0r0", 0, "r1", token_ids=ids("Hello there. ")))
        refused = ev.StageError("s1r0", 1, m.RequestError("r1/s1", f"talker (replica s1r0) is {how}", kind="unavailable"))
        acts = core.handle(refused)
        assert sends(acts) == [("s1r1", "r1/s1", True)] and not of(acts, ev.Fail)
        assert core.metrics.replays == {1: 1}
        acts = core.handle(output("s1r1", 1, "r1/s1", tensors={"latents": ref(1, "s1r1")}, finished=True))
        assert sends(acts) == [("s2r0", "r1", False)]
    # Nowhere else to go: the refusal fails the request, as before.
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "s2r0"))
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hello there. ")))
    acts = core.handle(ev.StageError("s1r0", 1, m.RequestError("r1/s1", "talker is asleep", kind="unavailable")))
    err = of(acts, ev.Fail)[0].error
    assert err.kind == errors.UNAVAILABLE and "stage 1 replica s1r0: talker is asleep" in str(err)
    # After the stage's first output, a refusal fails the request: its output was seen.
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(1, "s1r1"), replica(2, "s2r0"))
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hello there. Bye. ")))
    core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(1)}, finished=True))
    acts = core.handle(ev.StageError("s1r0", 1, m.RequestError("r1/s2", "talker is draining", kind="unavailable")))
    assert not of(acts, ev.Send) and "talker is draining" in str(of(acts, ev.Fail)[0].error)
