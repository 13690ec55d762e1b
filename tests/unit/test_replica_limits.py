"""Replicas of one stage that differ in max_model_len (issue 15, item 2): the orchestrator routes
by each replica's reported limit, answers a request no replica can take with a 400 naming the
limit, and counts failed requests as load."""

from __future__ import annotations

import msgspec
import pytest

from omni import errors
from omni.engines.base import SamplingParams
from omni.errors import BadRequest, StageFailed
from omni.master.types import TopologyEvent
from omni.orchestrator import events as ev
from omni.orchestrator.limits import replica_limits
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from tests.unit.test_orchestrator_core import make_core, replica


def limited(stage_id: int, rid: str, max_len: int | None):
    r = replica(stage_id, rid)
    caps = {"max_model_len": str(max_len)} if max_len else {}
    return msgspec.structs.replace(r, capabilities=caps)


def request(rid: str, n_prompt: int, max_tokens: int = 8) -> PipelineRequest:
    return PipelineRequest(request_id=rid, prompt_token_ids=[65] * n_prompt,
                           sampling=SamplingParams(max_tokens=max_tokens))


def test_long_prompts_go_only_to_replicas_whose_max_model_len_takes_them():
    # "a" sorts first and would win every tie on load; it only takes 1024 tokens.
    core = make_core(limited(0, "a-small", 1024), limited(0, "b-big", 2048))
    for i in range(4):
        core.submit(request(f"long{i}", 1500))
        assert core.requests[f"long{i}"].stages[0].replica.replica_id == "b-big"
    core.submit(request("short", 100))
    assert core.requests["short"].stages[0].replica.replica_id == "a-small"


def test_a_request_no_replica_can_take_is_a_400_naming_the_limit():
    core = make_core(limited(0, "a", 1024), limited(0, "b", 1536))
    with pytest.raises(BadRequest, match=r"needs 2008 tokens .*max_model_len.*the largest is 1536"):
        core.submit(request("huge", 2000))
    assert not core.requests


def test_failed_requests_count_as_load():
    now = [0.0]
    core = make_core(limited(0, "a", None), limited(0, "b", None))
    core.clock = lambda: now[0]
    core.submit(request("r1", 10))
    assert core.requests["r1"].stages[0].replica.replica_id == "a"
    core.handle(ev.StageError("a", 0, m.RequestError("r1", "boom", 0, "a")))
    core.submit(request("r2", 10))
    assert core.requests["r2"].stages[0].replica.replica_id == "b"   # a failed lately: not the least loaded
    now[0] = 60.0                                                      # ... until that ages out
    core.handle(ev.StageError("b", 0, m.RequestError("r2", "boom", 0, "b", kind="client")))  # not b's fault
    core.submit(request("r3", 10))
    assert core.requests["r3"].stages[0].replica.replica_id == "a"


def test_a_replica_reports_the_limit_its_engine_was_built_with():
    class Engine:
        max_model_len = 1024

    assert replica_limits(Engine()) == {"max_model_len": "1024"}
    assert replica_limits(object()) == {}


def test_a_replay_goes_only_to_a_replica_whose_max_model_len_takes_the_request():
    """Admitted by the largest replica's limit, a request replays only where it fits: to the other
    big replica, or, when only a smaller one is left, it fails as unavailable naming the limit."""
    for others, expect in (((limited(0, "a-small", 1024), limited(0, "c-big", 8192)), "c-big"),
                           ((limited(0, "a-small", 1024),), None)):
        core = make_core(limited(0, "b-big", 8192), *others)
        acts = core.submit(request("r1", 4000, max_tokens=100))
        assert [a.replica.replica_id for a in acts if isinstance(a, ev.Send)] == ["b-big"]
        gone = msgspec.structs.replace(limited(0, "b-big", 8192), state="SUSPECT")
        core.topology.apply(TopologyEvent("UPDATED", [gone], 2))
        acts = core.handle(ev.ReplicaGone(gone, "suspect"))
        sent = [a.replica.replica_id for a in acts if isinstance(a, ev.Send)]
        if expect:
            assert sent == [expect]
            continue
        assert not sent
        err = [a for a in acts if isinstance(a, ev.Fail)][0].error
        assert isinstance(err, StageFailed) and err.kind == errors.UNAVAILABLE
        assert ("replica is suspect; not replayed: the request needs 4100 tokens (4000 in the prompt, 100 max_tokens), "
                "more than the max_model_len of every other READY replica (the largest is 1024)") in str(err)


def test_audio_parts_go_only_to_replicas_whose_limit_takes_them():
    """The frontend admits up to the largest audio_limit among the thinker's replicas; the router sent such a
    request to the least loaded one, whose stage then refused it (a 400 one time in two)."""
    def audio(rid: str, limit: int | None):
        r = replica(0, rid)
        return msgspec.structs.replace(r, capabilities={"audio_limit": str(limit)} if limit is not None else {})

    def with_audio(rid: str, n: int) -> PipelineRequest:
        return msgspec.structs.replace(request(rid, 10), num_audio_inputs=n)

    # "a" sorts first and would win every tie on load; it takes one audio part.
    core = make_core(audio("a-one", 1), audio("b-two", 2))
    for i in range(3):
        core.submit(with_audio(f"two{i}", 2))
        assert core.requests[f"two{i}"].stages[0].replica.replica_id == "b-two"
    core.submit(with_audio("one", 1))
    assert core.requests["one"].stages[0].replica.replica_id == "a-one"
    core = make_core(audio("a-one", 1), audio("b-unknown", None))   # no limit registered: the stage checks
    core.submit(with_audio("two", 2))
    assert core.requests["two"].stages[0].replica.replica_id == "b-unknown"
    core = make_core(audio("a-one", 1))
    with pytest.raises(BadRequest, match=r"At most 1 audio\(s\) may be provided in one prompt to any ready .* "
                                         r"replica that fits its tokens; this one has 2 \(limit_mm_per_prompt\)\."):
        core.submit(with_audio("three", 2))


def test_a_chat_with_audio_goes_only_to_a_replica_whose_max_model_len_takes_its_expanded_prompt():
    """The frontend admits a chat by its prompt as vLLM expands each audio part (prompt_positions) against the
    largest replica; sized by its 100 unexpanded ids the router picked the smaller one, which refused it."""
    core = make_core(limited(0, "a-small", 2048), limited(0, "b-big", 8192))
    req = msgspec.structs.replace(request("r", 100, max_tokens=16), num_audio_inputs=1, prompt_positions=3999)
    core.submit(req)
    assert core.requests["r"].stages[0].replica.replica_id == "b-big"
    core = make_core(limited(0, "a-small", 2048))
    with pytest.raises(BadRequest, match=r"needs 4015 tokens \(3999 in the prompt, 16 max_tokens\)"):
        core.submit(msgspec.structs.replace(req, request_id="r2"))
