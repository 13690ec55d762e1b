"""The orchestrator core with no sockets and no processes: events in, actions out.

The pipeline is the default one's shape: thinker (0) -> talker (1, one sub-request per
sentence) -> code2wav (2, streamed latents); token ids are character codes here, so the
thinker's "text" is what its ids spell.
"""

from __future__ import annotations

import pytest

from omni import errors
from omni.config import parse
from omni.engines.base import SamplingParams
from omni.errors import BadRequest, StageFailed, Unavailable
from omni.master.types import ReplicaInfo, TopologyEvent
from omni.orchestrator import events as ev
from omni.orchestrator.core import OrchestratorCore
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.transport.base import TensorRef

CONFIG = parse({"model": "m", "pipeline": {"speech_entry_stage": 1}, "stages": [
    {"stage_id": 0, "name": "thinker", "engine": "count", "final_output": True, "final_output_type": "text"},
    {"stage_id": 1, "name": "talker", "engine": "piper_talker", "inputs": [0],
     "processor": "omni.models.piper.processors:thinker_to_talker", "default_sampling_params": {"noise_scale": 0.0}},
    {"stage_id": 2, "name": "code2wav", "engine": "count", "inputs": [1],
     "processor": "omni.models.piper.processors:talker_to_code2wav", "final_output": True, "final_output_type": "audio"},
]}, source="test")


def replica(stage_id: int, replica_id: str, host: str = "h1", state: str = "READY") -> ReplicaInfo:
    return ReplicaInfo(stage_id=stage_id, replica_id=replica_id, replica_index=0, role="STAGE", host=host, pid=1,
                       endpoints={"channel": f"tcp://{host}:1"}, state=state, queue_len=0, in_flight=0,
                       requests_total=0, cpu_seconds=0.0, is_sleeping=False, draining=False, extra={},
                       heartbeat_age_s=0.0, version="test", capabilities={})


def make_core(*replicas: ReplicaInfo, config=CONFIG) -> OrchestratorCore:
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", list(replicas), 1))
    return OrchestratorCore(config, topology=topo, detokenize=lambda ids: "".join(map(chr, ids)),
                            choose_transport=lambda a, b, configured: configured or ("shm" if a == b else "tcp"))


def ref(key: int, producer: str = "s1r0", transport: str = "shm") -> TensorRef:
    return TensorRef(transport=transport, endpoint=f"seg-{producer}", key=key, dtype="float32", shape=(4,),
                     nbytes=16)


def output(replica_id: str, stage_id: int, request_id: str, **kw) -> ev.StageOutput:
    return ev.StageOutput(replica_id, stage_id, m.Output(request_id=request_id, **kw))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def of(actions, kind) -> list:
    return [a for a in actions if isinstance(a, kind)]


def chat(rid: str = "r1", modalities=("text", "audio")) -> PipelineRequest:
    return PipelineRequest(request_id=rid, prompt_token_ids=[1, 2], modalities=modalities,
                           sampling=SamplingParams(max_tokens=8), voice="joe", speed=1.0)


def sends(actions) -> list[tuple[str, str, bool]]:
    """(replica, engine request id, final) of each Send."""
    return [(a.replica.replica_id, a.message.request_id, a.message.final) for a in of(actions, ev.Send)]


ALL = (replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "s2r0"))


def test_three_stages_text_and_audio_end_ok_with_nothing_aborted():
    core = make_core(*ALL)
    acts = core.submit(chat())
    assert sends(acts) == [("s0r0", "r1", True)]
    assert acts[0].message.prompt_token_ids == [1, 2]
    # Thinker output: text to the client, and the finished sentence to the talker at once.
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))
    assert of(acts, ev.Emit)[0].output.token_ids == ids("Hi. Yo")
    assert sends(acts) == [("s1r0", "r1/s1", True)]
    talk = of(acts, ev.Send)[0].message
    assert talk.text == "Hi." and talk.voice == "joe" and talk.overrides.noise_scale == 0.0
    assert talk.out_transport == "shm" and talk.out_tensors            # code2wav is on the same host
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("!"), finished=True, finish_reason="length"))
    assert sends(acts) == [("s1r0", "r1/s2", True)] and of(acts, ev.Send)[0].message.text == "Yo!"
    # The second sentence's latents arrive first: held until the first sentence is through.
    assert core.handle(output("s1r0", 1, "r1/s2", tensors={"latents": ref(2)}, finished=True)) == []
    acts = core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(1)}, finished=True))
    # Streamed to code2wav in sentence order; the talker is then done, so code2wav's
    # stream is closed with an empty final piece.
    assert sends(acts) == [("s2r0", "r1", False), ("s2r0", "r1", False), ("s2r0", "r1", True)]
    assert [a.message.tensors.get("latents") for a in of(acts, ev.Send)] == [ref(1), ref(2), None]
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(7, "s2r0")}, sample_rate=24000))
    emit = of(acts, ev.Emit)[0]
    assert emit.output.modality == "audio" and emit.output.sample_rate == 24000 and emit.tensor.key == 7
    assert of(acts, ev.Free) == [ev.Free("s2r0", "shm", (7,))]              # after the emit reads it
    assert acts.index(emit) < acts.index(of(acts, ev.Free)[0])
    acts = core.handle(output("s2r0", 2, "r1", finished=True))
    assert of(acts, ev.Free) == [ev.Free("s1r0", "shm", (1, 2))]   # code2wav is done with the latents
    assert [type(a) for a in acts] == [ev.Free, ev.Emit, ev.Finished]
    assert acts[1].output.finished and acts[1].output.finish_reason == "length" and acts[2].outcome == "ok"
    assert core.metrics.outcomes == {"ok": 1, "aborted": 0, "failed": 0}


def test_streamed_edge_is_closed_with_an_empty_final_piece_and_inputs_are_freed():
    core = make_core(*ALL)
    core.submit(PipelineRequest(request_id="sp", text="Hello there.", entry_stage=1, modalities=("audio",)))
    acts = core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}))
    assert sends(acts) == [("s2r0", "sp", False)]
    acts = core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(2)}, finished=True))
    assert sends(acts) == [("s2r0", "sp", False), ("s2r0", "sp", True)]
    last = of(acts, ev.Send)[-1].message
    assert last.tensors == {} and last.final is True
    acts = core.handle(output("s2r0", 2, "sp", tensors={"audio": ref(9, "s2r0")}, sample_rate=22050,
                              finished=True))
    kinds = [type(a) for a in acts]
    assert kinds == [ev.Emit, ev.Free, ev.Free, ev.Finished], acts
    # The latents go back to the talker that made them, once code2wav finished with them.
    assert of(acts, ev.Free)[1] == ev.Free("s1r0", "shm", (1, 2))
    # The last audio is the finishing output itself (no empty one after it).
    assert acts[0].output.finished and acts[0].output.modality == "audio" and acts[-1].outcome == "ok"
    assert core.requests == {} and core.by_replica == {}
    assert core.metrics.outcomes == {"ok": 1, "aborted": 0, "failed": 0}


def test_text_only_request_needs_no_talker_or_code2wav():
    core = make_core(replica(0, "s0r0"))                  # no talker, no code2wav replica at all
    req = chat(modalities=("text",))
    assert core.needed_stages(req) == [0]
    core.submit(req)
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("Done. Really."), finished=True, finish_reason="stop",
                              stop_reason=46))
    assert not of(acts, ev.Send) and not of(acts, ev.AbortStage)
    # One output: the last tokens carry the finish (a stream's last token chunk has finish_reason),
    # and the stop token id that ended it (vLLM's stop_reason).
    emits = of(acts, ev.Emit)
    assert [(e.output.token_ids, e.output.finished, e.output.finish_reason, e.output.stop_reason) for e in emits] == \
        [(ids("Done. Really."), True, "stop", 46)]
    assert of(acts, ev.Finished)[0].outcome == "ok"
    with pytest.raises(Unavailable, match="talker"):
        core.submit(chat("r2"))                           # audio needs the talker: 503, nothing sent
    assert "r2" not in core.requests


def test_bad_requests_are_refused_before_anything_is_sent():
    core = make_core(*ALL)
    with pytest.raises(BadRequest, match="video"):
        core.submit(chat(modalities=("video",)))
    core.submit(chat())
    with pytest.raises(BadRequest, match="already in flight"):
        core.submit(chat())


def test_entry_replica_dies_before_any_output_the_request_is_replayed():
    core = make_core(replica(0, "s0r0"), replica(0, "s0r1"), replica(1, "s1r0"), replica(2, "s2r0"))
    first = core.submit(chat(modalities=("text",)))
    dead = first[0].replica
    core.topology.apply(TopologyEvent("UPDATED", [replica(0, dead.replica_id, state="SUSPECT")], 2))
    acts = core.handle(ev.ReplicaGone(dead, "suspect"))
    other = "s0r1" if dead.replica_id == "s0r0" else "s0r0"
    assert sends(acts) == [(other, "r1", True)]
    assert of(acts, ev.AbortStage) == [ev.AbortStage(dead.replica_id, ("r1",))]   # SUSPECT: it may be alive
    assert of(acts, ev.Send)[0].message.prompt_token_ids == [1, 2]
    assert core.metrics.replays == {0: 1}
    # The first replica was only SUSPECT: what it still sends for the request is freed, not used.
    late = core.handle(output(dead.replica_id, 0, "r1", token_ids=[66], tensors={"h": ref(4, dead.replica_id)}))
    assert late == [ev.Free(dead.replica_id, "shm", (4,))]
    assert core.handle(ev.StageError(dead.replica_id, 0, m.RequestError("r1", "stopping"))) == []
    acts = core.handle(output(other, 0, "r1", token_ids=[65], finished=True))
    assert [(a.output.token_ids, a.output.finished) for a in of(acts, ev.Emit)] == [([65], True)]
    assert of(acts, ev.Finished)[0].outcome == "ok"


def test_a_replay_never_goes_back_to_a_replica_the_request_already_ran_on():
    """r1 runs on s0r0, which goes SUSPECT (its channel closed: what it still finishes is lost), so
    r1 is replayed on s0r1; s0r0 comes back READY; s0r1 dies before output. s0r0 would drop the same
    request id again (its stream ended there) and the request would hang until its timeout: it goes
    to a third replica, or fails at once saying why."""
    for third, expect in ((replica(0, "s0r2"), "s0r2"), (None, None)):
        core = make_core(replica(0, "s0r0"), replica(0, "s0r1"), *([third] if third else []),
                         replica(1, "s1r0"), replica(2, "s2r0"))
        assert sends(core.submit(chat(modalities=("text",)))) == [("s0r0", "r1", True)]
        for dead, back in (("s0r0", None), ("s0r1", "s0r0")):
            gone = replica(0, dead, state="SUSPECT")
            core.topology.apply(TopologyEvent("UPDATED", [gone] + ([replica(0, back)] if back else []), 2))
            acts = core.handle(ev.ReplicaGone(gone, "suspect"))
        if expect:
            assert sends(acts) == [(expect, "r1", True)] and core.metrics.replays == {0: 2}
            continue
        assert not of(acts, ev.Send) and core.metrics.replays == {0: 1}
        err = of(acts, ev.Fail)[0].error
        assert isinstance(err, StageFailed) and err.kind == errors.UNAVAILABLE
        assert ("stage 0 replica s0r1: replica is suspect; not replayed: the request already went to every other "
                "READY replica of the stage (s0r0)") in str(err)


def test_a_replica_that_refused_the_request_or_was_restarted_may_take_it_back():
    """ran_on held every replica a request moved off, by replica id: one that only refused it (asleep,
    draining: it never took it) and one restarted under its id (a fresh process: it knows nothing of the
    request) were skipped too, so the request failed 'already went to every other READY replica' instead."""
    import msgspec

    from omni.stage import messages as m

    # s0r0 refuses (asleep), r1 moves to s0r1, which goes SUSPECT before output: back to s0r0 (awake now).
    core = make_core(replica(0, "s0r0"), replica(0, "s0r1"), replica(1, "s1r0"), replica(2, "s2r0"))
    assert sends(core.submit(chat(modalities=("text",)))) == [("s0r0", "r1", True)]
    acts = core.handle(ev.StageError("s0r0", 0, m.RequestError("r1", "thinker (replica s0r0) is asleep",
                                                                kind="unavailable")))
    assert sends(acts) == [("s0r1", "r1", True)]
    gone = replica(0, "s0r1", state="SUSPECT")
    core.topology.apply(TopologyEvent("UPDATED", [gone], 2))
    acts = core.handle(ev.ReplicaGone(gone, "suspect"))
    assert sends(acts) == [("s0r0", "r1", True)] and not of(acts, ev.Fail)
    # Two refusers do not bounce it while the topology lags: the second refusal fails it.
    core = make_core(replica(0, "s0r0"), replica(0, "s0r1"), replica(1, "s1r0"), replica(2, "s2r0"))
    core.submit(chat(modalities=("text",)))
    core.handle(ev.StageError("s0r0", 0, m.RequestError("r1", "thinker is asleep", kind="unavailable")))
    acts = core.handle(ev.StageError("s0r1", 0, m.RequestError("r1", "thinker is draining", kind="unavailable")))
    assert not of(acts, ev.Send)
    assert "thinker is draining; not replayed: the request already went to every other READY" in str(
        of(acts, ev.Fail)[0].error)
    # s0r0 goes SUSPECT, r1 moves to s0r1; s0r0 comes back as a new process (pid 2); s0r1 dies: to the new s0r0.
    core = make_core(replica(0, "s0r0"), replica(0, "s0r1"), replica(1, "s1r0"), replica(2, "s2r0"))
    core.submit(chat(modalities=("text",)))
    gone = replica(0, "s0r0", state="SUSPECT")
    core.topology.apply(TopologyEvent("UPDATED", [gone], 2))
    assert sends(core.handle(ev.ReplicaGone(gone, "suspect"))) == [("s0r1", "r1", True)]
    restarted = msgspec.structs.replace(replica(0, "s0r0"), pid=2)
    gone = replica(0, "s0r1", state="SUSPECT")
    core.topology.apply(TopologyEvent("UPDATED", [restarted, gone], 3))
    acts = core.handle(ev.ReplicaGone(gone, "suspect"))
    assert sends(acts) == [("s0r0", "r1", True)] and not of(acts, ev.Fail)


def test_a_draining_replica_gets_the_rest_of_what_it_began_and_nothing_new():
    core = make_core(*ALL)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))                          # the talker got "Hi."
    core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(1)}, finished=True))   # code2wav got its latents
    core.topology.apply(TopologyEvent("UPDATED", [replica(1, "s1r0", state="DRAINING"),
                                                  replica(2, "s2r0", state="DRAINING")], 2))
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("!"), finished=True, finish_reason="stop"))
    assert sends(acts) == [("s1r0", "r1/s2", True)] and not of(acts, ev.Fail)     # the next sentence
    acts = core.handle(output("s1r0", 1, "r1/s2", tensors={"latents": ref(2)}, finished=True))
    assert sends(acts) == [("s2r0", "r1", False), ("s2r0", "r1", True)]           # the stream's rest
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(7, "s2r0")}, sample_rate=24000, finished=True))
    assert of(acts, ev.Finished)[0].outcome == "ok"
    with pytest.raises(Unavailable, match="stage 1"):                              # nothing new goes there
        core.submit(chat("r2"))
    # A replica that is gone (SUSPECT) still fails the started stage at its next send.
    core = make_core(*ALL)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))
    core.topology.apply(TopologyEvent("UPDATED", [replica(1, "s1r0", state="SUSPECT")], 2))
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("!"), finished=True))
    assert not of(acts, ev.Send) and "stage 1 replica s1r0: replica is gone" in str(of(acts, ev.Fail)[0].error)


def test_a_replica_restarted_under_its_id_while_the_watch_was_down_fails_what_the_old_one_held():
    import msgspec

    core = make_core(*ALL)
    seen, acts = [], []

    def on_change(r, kind):   # as the executor: a stage replica REMOVED is gone for the core
        seen.append((r.replica_id, r.pid, kind))
        if kind == "REMOVED":
            acts.extend(core.handle(ev.ReplicaGone(r, "gone")))
    core.topology.on_change(on_change)
    core.submit(chat(modalities=("text",)))
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi")))           # past its first output: no replay
    # The watch stream comes back with a snapshot: s0r0 is another process now, the others as they were.
    restarted = msgspec.structs.replace(replica(0, "s0r0"), pid=2, endpoints={"channel": "tcp://h1:2"})
    core.topology.apply(TopologyEvent("SNAPSHOT", [restarted, replica(1, "s1r0"), replica(2, "s2r0")], 5))
    assert seen == [("s0r0", 1, "REMOVED"), ("s0r0", 2, "ADDED"), ("s1r0", 1, "UPDATED"), ("s2r0", 1, "UPDATED")]
    fail = of(acts, ev.Fail)[0].error
    assert isinstance(fail, StageFailed) and "stage 0 replica s0r0: replica is gone" in str(fail)
    assert of(acts, ev.Finished)[0].outcome == "failed" and core.topology.replicas["s0r0"].pid == 2


def speech_with_code2wav_on(*code2wav: ReplicaInfo) -> tuple[OrchestratorCore, list]:
    """A speech request whose talker finished (its shm latents all sent to code2wav); then
    the code2wav replica it went to dies. -> (core, actions of that death)."""
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), *code2wav)
    core.submit(PipelineRequest(request_id="sp", text="Hi.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}, finished=True))
    dead = core.requests["sp"].stages[2].replica
    assert dead.replica_id == "a-h1"                         # least loaded, then by id
    dead = replica(2, dead.replica_id, state="DEAD")
    core.topology.apply(TopologyEvent("UPDATED", [dead], 2))
    return core, core.handle(ev.ReplicaGone(dead, "dead"))


def _hold_config():
    import msgspec
    raw = msgspec.to_builtins(CONFIG)
    raw["stages"][1]["first_output_hold_ms"] = 200
    return parse(raw, source="test")


def test_talker_hold_is_asked_until_the_first_audio_then_released():
    core = make_core(*ALL, config=_hold_config())
    acts = core.submit(PipelineRequest(request_id="sp", text="One. Two.", entry_stage=1, modalities=("audio",)))
    (talk,) = of(acts, ev.Send)
    assert talk.message.hold_ms == 200
    acts = core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}))
    assert [a.message.hold_ms for a in of(acts, ev.Send)] == [0.0]      # code2wav's own input holds nothing
    acts = core.handle(output("s2r0", 2, "sp", tensors={"audio": ref(7, "s2r0")}, sample_rate=22050))
    assert of(acts, ev.ReleaseHold) == [ev.ReleaseHold("s1r0", ("sp",))]
    acts = core.handle(output("s2r0", 2, "sp", tensors={"audio": ref(8, "s2r0")}, sample_rate=22050))
    assert not of(acts, ev.Send) and not of(acts, ev.ReleaseHold)      # released once


def test_no_hold_is_asked_once_the_first_audio_is_out_and_text_does_not_release():
    core = make_core(*ALL, config=_hold_config())
    core.submit(chat())
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))
    assert of(acts, ev.Send)[0].message.hold_ms == 200     # the thinker's text is no audio
    core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(1)}, finished=True))
    acts = core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(7, "s2r0")}, sample_rate=22050))
    assert not of(acts, ev.ReleaseHold)                                 # nothing left open
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("!"), finished=True, finish_reason="stop"))
    assert [a.message.hold_ms for a in of(acts, ev.Send)] == [0.0]      # audio is out: no hold


def test_downstream_shm_inputs_replay_only_on_the_same_host():
    core, acts = speech_with_code2wav_on(replica(2, "a-h1"), replica(2, "b-h2", host="h2"), replica(2, "c-h1"))
    assert sends(acts) == [("c-h1", "sp", False), ("c-h1", "sp", True)]     # both pieces, in order
    assert core.metrics.replays == {2: 1}
    core, acts = speech_with_code2wav_on(replica(2, "a-h1"), replica(2, "b-h2", host="h2"))
    assert not of(acts, ev.Send)                             # h2 cannot map h1's shared memory
    fail = of(acts, ev.Fail)[0].error
    assert isinstance(fail, StageFailed) and fail.kind == errors.UNAVAILABLE
    assert "stage 2 replica a-h1: replica is dead" in str(fail)
    assert of(acts, ev.Finished)[0].outcome == "failed"


def test_no_replay_when_the_inputs_producer_is_gone_too_the_request_fails_at_once_naming_it():
    """Its tensors cannot be read again: a replay would fail after the new replica's read timeout,
    blaming that healthy replica."""
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "a-h1"), replica(2, "c-h1"))
    core.submit(PipelineRequest(request_id="sp", text="Hi.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}, finished=True))     # the talker is done
    core.topology.apply(TopologyEvent("UPDATED", [replica(1, "s1r0", state="DEAD")], 2))   # and then gone
    dead = replica(2, "a-h1", state="DEAD")
    core.topology.apply(TopologyEvent("UPDATED", [dead], 3))
    acts = core.handle(ev.ReplicaGone(dead, "dead"))
    assert not of(acts, ev.Send) and core.metrics.replays == {}
    fail = of(acts, ev.Fail)[0].error
    assert isinstance(fail, StageFailed) and fail.kind == errors.UNAVAILABLE
    assert "stage 2 replica a-h1: replica is gone; not replayed: the replica that made its inputs is gone too: " \
           "s1r0 (DEAD)" in str(fail)
    assert of(acts, ev.Finished)[0].outcome == "failed"


def test_a_stage_still_receiving_inputs_is_replayed_and_later_inputs_follow():
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "a-h1"), replica(2, "c-h1"))
    core.submit(PipelineRequest(request_id="sp", text="Hi. Yo.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}))          # the talker goes on
    dead = replica(2, "a-h1", state="DEAD")
    core.topology.apply(TopologyEvent("UPDATED", [dead], 2))
    acts = core.handle(ev.ReplicaGone(dead, "dead"))
    assert sends(acts) == [("c-h1", "sp", False)] and of(acts, ev.Send)[0].message.tensors["latents"] == ref(1)
    acts = core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(2)}, finished=True))
    assert sends(acts) == [("c-h1", "sp", False), ("c-h1", "sp", True)]
    acts = core.handle(output("c-h1", 2, "sp", tensors={"audio": ref(3, "c-h1")}, sample_rate=16000,
                              finished=True))
    assert of(acts, ev.Finished)[0].outcome == "ok"
    assert ev.Free("s1r0", "shm", (1, 2)) in acts                 # the latents sent twice are freed once


def test_failure_after_partial_output_fails_and_aborts_what_is_left():
    core = make_core(*ALL)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("One. Tw")))            # the talker got "One."
    core.topology.apply(TopologyEvent("UPDATED", [replica(0, "s0r0", state="DEAD")], 2))
    acts = core.handle(ev.ReplicaGone(replica(0, "s0r0", state="DEAD"), "dead"))
    assert [type(a) for a in acts] == [ev.Fail, ev.AbortStage, ev.AbortStage, ev.Finished], acts
    err = acts[0].error
    assert isinstance(err, StageFailed) and "stage 0 replica s0r0: replica is dead" in str(err)
    assert of(acts, ev.AbortStage)[1] == ev.AbortStage("s1r0", ("r1", "r1/s1"))
    assert acts[-1].outcome == "failed" and core.metrics.outcomes["failed"] == 1
    # Outputs that were on their way are only freed.
    late = core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(3)}))
    assert late == [ev.Free("s1r0", "shm", (3,))]


def test_stage_error_carries_its_kind():
    core = make_core(*ALL)
    core.submit(chat(modalities=("text",)))
    acts = core.handle(ev.StageError("s0r0", 0, m.RequestError("r1", "prompt too long", 0, "s0r0", kind="client")))
    err = of(acts, ev.Fail)[0].error
    assert isinstance(err, StageFailed) and err.kind == errors.CLIENT and "prompt too long" in str(err)
    assert of(acts, ev.AbortStage) == [ev.AbortStage("s0r0", ("r1",))]


def test_a_refusal_names_its_request_only_from_the_entry_stage():
    """Only the entry stage read the client's own input: the frontend answers its refusal in the engine's
    words; a later stage refused another stage's output, and the answer keeps which stage it was."""
    core = make_core(*ALL)
    core.submit(PipelineRequest(request_id="sp", text="—", entry_stage=1, modalities=("audio",)))
    acts = core.handle(ev.StageError("s1r0", 1, m.RequestError("sp", "EngineError: request sp: nothing to speak",
                                                               1, "s1r0", kind="client")))
    assert of(acts, ev.Fail)[0].error.entry_rid == "sp"
    core.submit(PipelineRequest(request_id="sp2", text="Hi.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp2", tensors={"latents": ref(1)}))
    acts = core.handle(ev.StageError("s2r0", 2, m.RequestError("sp2", "EngineError: request sp2: codes must lie in "
                                                               "[0, 4)", 2, "s2r0", kind="client")))
    err = of(acts, ev.Fail)[0].error
    assert err.kind == errors.CLIENT and err.stage_id == 2 and err.entry_rid is None


def test_client_abort_aborts_every_started_stage_and_frees_inputs():
    core = make_core(*ALL)
    core.submit(PipelineRequest(request_id="sp", text="A. B.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}))
    acts = core.handle(ev.Cancel("sp"))
    assert of(acts, ev.AbortStage) == [ev.AbortStage("s1r0", ("sp",)), ev.AbortStage("s2r0", ("sp",))]
    assert of(acts, ev.Free) == [ev.Free("s1r0", "shm", (1,))]     # latents sent to code2wav
    assert of(acts, ev.Finished)[0].outcome == "aborted" and not of(acts, ev.Fail)
    assert core.handle(ev.Cancel("sp")) == []                       # once only
    assert core.metrics.outcomes == {"ok": 0, "aborted": 1, "failed": 0}


def test_audio_without_a_sample_rate_fails_naming_the_stage():
    core = make_core(*ALL)
    core.submit(PipelineRequest(request_id="sp", text="Hi.", entry_stage=1, modalities=("audio",)))
    core.handle(output("s1r0", 1, "sp", tensors={"latents": ref(1)}, finished=True))
    acts = core.handle(output("s2r0", 2, "sp", tensors={"audio": ref(5, "s2r0")}))
    assert "stage 2 (code2wav) sent audio without a sample rate" in str(of(acts, ev.Fail)[0].error)


IMAGES = parse({"model": "m", "stages": [
    {"stage_id": 0, "name": "dit", "engine": "count", "inputs": ["text"], "final_output": True,
     "final_output_type": "image"}]}, source="test")
AR_IMAGES = parse({"model": "m", "stages": [
    {"stage_id": 0, "name": "writer", "engine": "count"},
    {"stage_id": 1, "name": "dit", "engine": "count", "inputs": [0],
     "processor": "omni.models.qwen_image.processors:lm_to_dit", "final_output": True,
     "final_output_type": "image"}]}, source="test")


def image_request(**kw) -> PipelineRequest:
    from omni.engines.base import ImageParams

    return PipelineRequest(request_id="img", modalities=("image",), image=ImageParams(
        width=32, height=16, num_inference_steps=3, guidance_scale=4.0, negative_prompt=" ", n=2, seed=9), **kw)


def test_an_image_request_carries_its_parameters_to_the_stage_and_its_image_back():
    core = make_core(replica(0, "s0r0"), config=IMAGES)
    req = image_request(text="a cat")
    acts = core.submit(req)
    add = of(acts, ev.Send)[0].message
    assert add.text == "a cat" and add.image == req.image
    # The stage channel's typed decoder keeps the field typed.
    assert m.stage_codec().decode(m.stage_codec().encode(add)).image == req.image
    image = TensorRef(transport="shm", endpoint="seg-s0r0", key=3, dtype="uint8", shape=(2, 16, 32, 3), nbytes=3072)
    acts = core.handle(output("s0r0", 0, "img", tensors={"image": image}, finished=True, finish_reason="stop"))
    emit = of(acts, ev.Emit)[0]
    assert emit.output.modality == "image" and emit.tensor == image and emit.output.finished
    assert emit.output.prompt is None      # the client's own prompt: nothing was revised
    assert of(acts, ev.Finished)[0].outcome == "ok"


def test_an_upstream_stage_can_write_the_image_stages_prompt():
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), config=AR_IMAGES)
    req = image_request(prompt_token_ids=[1, 2])
    assert core.needed_stages(req) == [0, 1]
    core.submit(req)
    assert not of(core.handle(output("s0r0", 0, "img", token_ids=ids("a red "))), ev.Send)
    acts = core.handle(output("s0r0", 0, "img", token_ids=ids("cat"), finished=True))
    add = of(acts, ev.Send)[0].message
    assert (add.request_id, add.text, add.image, add.final) == ("img", "a red cat", req.image, True)
    image = TensorRef(transport="shm", endpoint="seg-s1r0", key=1, dtype="uint8", shape=(2, 16, 32, 3), nbytes=3072)
    acts = core.handle(output("s1r0", 1, "img", tensors={"image": image}, finished=True))
    emit = of(acts, ev.Emit)[0]
    # The image reports the prompt it was made from (the client's revised prompt); the writer's text
    # went to no client (not asked for).
    assert emit.output.modality == "image" and emit.output.prompt == "a red cat" and emit.output.finished
    assert len(of(acts, ev.Emit)) == 1 and of(acts, ev.Finished)[0].outcome == "ok"
