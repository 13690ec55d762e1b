"""The orchestrator core when a stage ends its part of a request early, or a replica goes
after its stage is done: the Qwen3-Omni shape, thinker -> talker (streamed pieces) -> code2wav."""

from __future__ import annotations

from omni.config import parse
from omni.errors import Unavailable
from omni.orchestrator import events as ev
from omni.stage import messages as m
from tests.unit.test_orchestrator_core import ALL, chat, make_core, of, output, ref, replica, sends

Q3 = parse({"model": "m", "stages": [
    {"stage_id": 0, "name": "thinker", "engine": "count", "final_output": True, "final_output_type": "text"},
    {"stage_id": 1, "name": "talker", "engine": "count", "inputs": [0],
     "processor": "omni.models.qwen3_omni.processors:thinker_to_talker"},
    {"stage_id": 2, "name": "code2wav", "engine": "count", "inputs": [1],
     "processor": "omni.models.qwen3_omni.processors:talker_to_code2wav", "final_output": True,
     "final_output_type": "audio"},
]}, source="test")


def test_a_talker_that_ends_its_stream_early_closes_code2wavs_input_at_once_and_the_request_ends_ok():
    core = make_core(*ALL, config=Q3)
    core.submit(chat())
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[5, 6], tensors={"prompt_token_ids": ref(3, "s0r0")}))
    assert sends(acts) == [("s1r0", "r1", False)]
    # max_tokens (or a full KV cache, a codec EOS) ends the talker's request while the thinker goes on:
    # code2wav gets its last piece and its closing one now, not when the thinker finishes.
    acts = core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(1)}, finished=True, finish_reason="length"))
    assert sends(acts) == [("s2r0", "r1", False), ("s2r0", "r1", True)] and ev.Free("s0r0", "shm", (3,)) in acts
    assert not of(acts, ev.AbortStage)                        # text was asked for: the thinker goes on
    assert core.load(ALL[1])[0] == 0                          # the talker holds nothing of it now
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(9, "s2r0")}, sample_rate=24000,
                              finished=True))
    assert not of(acts, ev.Emit)[0].output.finished and not of(acts, ev.Finished)   # the text is not done
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[7]))
    assert not of(acts, ev.Send) and of(acts, ev.Emit)[0].output.token_ids == [7]
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[8], finished=True, finish_reason="stop"))
    assert not of(acts, ev.Send) and not of(acts, ev.Fail) and not of(acts, ev.AbortStage)
    last = of(acts, ev.Emit)[-1].output
    assert last.token_ids == [8] and last.finished and last.finish_reason == "stop"
    assert of(acts, ev.Finished)[0].outcome == "ok" and not core.requests and not core.by_replica


def test_an_audio_only_request_whose_talker_ended_early_aborts_the_thinker_and_ends_with_code2wav():
    core = make_core(*ALL, config=Q3)
    core.submit(chat(modalities=("audio",)))
    core.handle(output("s0r0", 0, "r1", token_ids=[5, 6], tensors={"prompt_token_ids": ref(3, "s0r0")}))
    acts = core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(1)}, finished=True, finish_reason="stop"))
    # No one reads the thinker's further text: it is stopped there, its tensors freed.
    assert sends(acts) == [("s2r0", "r1", False), ("s2r0", "r1", True)]
    assert of(acts, ev.AbortStage) == [ev.AbortStage("s0r0", ("r1",))] and ev.Free("s0r0", "shm", (3,)) in acts
    assert core.load(ALL[0])[0] == 0 and core.load(ALL[1])[0] == 0
    # An output the thinker sent before it took the Abort is only freed.
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[7], tensors={"h": ref(4, "s0r0")}))
    assert acts == [ev.Free("s0r0", "shm", (4,))]
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(9, "s2r0")}, sample_rate=24000,
                              finished=True))
    emit = of(acts, ev.Emit)[0]
    assert emit.output.modality == "audio" and emit.output.finished and emit.output.finish_reason == "stop"
    assert of(acts, ev.Finished)[0].outcome == "ok" and not of(acts, ev.AbortStage)
    assert not core.requests and not core.by_replica
    assert core.handle(output("s0r0", 0, "r1", token_ids=[8], finished=True)) == []


def test_a_thinker_error_that_crosses_its_abort_as_unneeded_does_not_fail_an_audio_only_request():
    core = make_core(*ALL, config=Q3)
    core.submit(chat(modalities=("audio",)))
    core.handle(output("s0r0", 0, "r1", token_ids=[5, 6], tensors={"prompt_token_ids": ref(3, "s0r0")}))
    acts = core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(1)}, finished=True, finish_reason="stop"))
    assert of(acts, ev.AbortStage) == [ev.AbortStage("s0r0", ("r1",))]
    # The thinker failed the request before it took the Abort: no one needs its output any more.
    acts = core.handle(ev.StageError("s0r0", 0, m.RequestError("r1", "engine step failed: boom", 0, "s0r0")))
    assert not of(acts, ev.Fail) and not of(acts, ev.Finished) and "r1" in core.requests
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(9, "s2r0")}, sample_rate=24000,
                              finished=True))
    assert of(acts, ev.Emit)[0].output.finished and of(acts, ev.Finished)[0].outcome == "ok"
    assert not of(acts, ev.Fail) and not core.requests


HELD = parse({"model": "m", "stages": [
    {"stage_id": 0, "name": "a", "engine": "count"},
    {"stage_id": 1, "name": "b", "engine": "count", "inputs": [0], "final_output": True, "final_output_type": "text"},
]}, source="test")


def test_a_held_back_piece_for_a_stage_that_ended_is_freed_not_sent_and_its_feeder_stopped():
    core = make_core(*ALL[:2], config=HELD)
    core.submit(chat(modalities=("text",)))
    core.handle(output("s0r0", 0, "r1", token_ids=[5], tensors={"h": ref(1, "s0r0")}))   # held back by one
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[6], tensors={"h": ref(2, "s0r0")}))
    assert sends(acts) == [("s1r0", "r1", False)]
    # b ends its stream (max_tokens): a's output went to b only, so a works for no one now.
    acts = core.handle(output("s1r0", 1, "r1", token_ids=[9], finished=True, finish_reason="length"))
    assert not of(acts, ev.Send) and ev.Free("s0r0", "shm", (1,)) in acts and ev.Free("s0r0", "shm", (2,)) in acts
    assert of(acts, ev.AbortStage) == [ev.AbortStage("s0r0", ("r1",))]
    assert of(acts, ev.Emit)[0].output.finish_reason == "length" and of(acts, ev.Finished)[0].outcome == "ok"
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[7], tensors={"h": ref(3, "s0r0")}, finished=True))
    assert acts == [ev.Free("s0r0", "shm", (3,))]


def test_losing_the_thinkers_replica_after_it_finished_the_request_does_not_fail_it():
    core = make_core(*ALL, config=Q3)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=[5, 6]))
    core.handle(output("s0r0", 0, "r1", token_ids=[7], finished=True, finish_reason="stop"))
    assert core.load(ALL[0])[0] == 0                       # finished work there counts as load no more
    assert sends(core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(1)}))) == [("s2r0", "r1", False)]
    assert core.handle(ev.ReplicaGone(ALL[0], "suspect")) == []
    core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(2)}, finished=True))
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(9, "s2r0")}, sample_rate=24000,
                              finished=True))
    assert not of(acts, ev.Fail) and of(acts, ev.Finished)[0].outcome == "ok"


def talker_gone_before_its_first_piece(*talkers):
    """The talker picked at admission ("s1a", on h1 as the thinker) goes before anything was sent
    to it; then the thinker's first output (its expanded prompt, in shm) is routed. -> (core, actions)."""
    core = make_core(replica(0, "s0r0"), replica(1, "s1a"), *talkers, replica(2, "s2r0"), config=Q3)
    core.submit(chat())
    assert core.requests["r1"].stages[1].replica.replica_id == "s1a"
    core.handle(ev.ReplicaGone(replica(1, "s1a"), "suspect"))
    core.topology.replicas.pop("s1a")
    return core, core.handle(output("s0r0", 0, "r1", token_ids=[5], tensors={"prompt_token_ids": ref(3, "s0r0")}))


def test_a_stage_picked_again_takes_a_replica_on_the_host_of_its_shared_memory_input():
    _, acts = talker_gone_before_its_first_piece(replica(1, "s1b", "h2"), replica(1, "s1c", "h1"))
    assert sends(acts) == [("s1c", "r1", False)]
    _, acts = talker_gone_before_its_first_piece(replica(1, "s1b", "h2"))
    assert not of(acts, ev.Send) and of(acts, ev.Finished)[0].outcome == "failed"
    err = of(acts, ev.Fail)[0].error
    assert isinstance(err, Unavailable) and "stage 1 (talker) has no READY replica on h1" in str(err)


def test_losing_the_replica_of_a_talker_that_ended_early_does_not_fail_the_request():
    core = make_core(*ALL, config=Q3)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=[5, 6]))
    core.handle(output("s1r0", 1, "r1", tensors={"codes": ref(1)}, finished=True, finish_reason="length"))
    assert core.handle(ev.ReplicaGone(ALL[1], "dead")) == []       # the thinker still streams
    acts = core.handle(output("s0r0", 0, "r1", token_ids=[7], finished=True))
    assert not of(acts, ev.Send) and not of(acts, ev.Finished)       # code2wav's input closed already
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(9, "s2r0")}, sample_rate=24000,
                              finished=True))
    assert not of(acts, ev.Fail) and of(acts, ev.Finished)[0].outcome == "ok"
