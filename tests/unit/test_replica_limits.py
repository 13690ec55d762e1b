"""Replicas of one stage that differ in max_model_len (issue 15, item 2): the orchestrator routes
by each replica's reported limit, answers a request no replica can take with a 400 naming the
limit, and counts failed requests as load."""

from __future__ import annotations

import msgspec
import pytest

from omni.engines.base import SamplingParams
from omni.errors import BadRequest
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
