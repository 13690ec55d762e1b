"""vLLM's `request_id` names the answer as vLLM's server does (chatcmpl-<id>, cmpl-<id>; vLLM 0.32
chat_completion/serving.py and completion/serving.py), bounded; OpenAI's `moderation` is refused by name."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, chat_body, make, sse_events, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_request_id_is_the_answers_id_as_vllm(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    d = (await c.post("/v1/chat/completions", json=chat_body(request_id="trace-42"))).json()
    assert d["id"] == "chatcmpl-trace-42"
    evs = sse_events((await c.post("/v1/chat/completions", json=chat_body(request_id="trace-43", stream=True))).text)
    assert {e["id"] for e in evs} == {"chatcmpl-trace-43"}
    d = (await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "request_id": "t44"})).json()
    assert d["id"] == "cmpl-t44"
    evs = sse_events((await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True,
                                                            "request_id": "t45"})).text)
    assert {e["id"] for e in evs} == {"cmpl-t45"}
    # the pipeline's ids stay its own: two requests may send one request_id
    d2 = (await c.post("/v1/chat/completions", json=chat_body(request_id="trace-42"))).json()
    assert d2["id"] == "chatcmpl-trace-42"
    rids = [r.request_id for r in orch.requests]
    assert len(set(rids)) == len(rids) and not any("trace" in r for r in rids)


async def test_no_request_id_keeps_a_fresh_id(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    d = (await c.post("/v1/chat/completions", json=chat_body())).json()
    assert d["id"] == orch.requests[0].request_id and d["id"].startswith("chatcmpl-")


@pytest.mark.parametrize("rid", ["", "has space", "x" * 257, "tab\there", "é"])
async def test_a_request_id_out_of_bounds_is_refused_by_name(tokenizer, rid):  # noqa: F811
    orch, c = make(tokenizer)
    assert_error(await c.post("/v1/chat/completions", json=chat_body(request_id=rid)), 400, "request_id")
    assert_error(await c.post("/v1/completions", json={"prompt": "hi", "request_id": rid}), 400, "request_id")
    assert orch.requests == []


async def test_moderation_is_refused_by_name(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    body = chat_body(moderation={"input": {"policy": "default"}})
    assert_error(await c.post("/v1/chat/completions", json=body), 400, "moderation", "moderation")
    assert (await c.post("/v1/chat/completions", json=chat_body(moderation=None))).status_code == 200
    assert len(orch.requests) == 1


async def test_the_x_request_id_header_names_the_answer_over_the_body_as_vllm(tokenizer):  # noqa: F811
    """vLLM 0.32's serving (_base_request_id) takes the header first; omni read only the body."""
    orch, c = make(tokenizer)
    h = {"X-Request-Id": "hdr-1"}
    d = (await c.post("/v1/chat/completions", json=chat_body(request_id="body-1"), headers=h)).json()
    assert d["id"] == "chatcmpl-hdr-1"
    evs = sse_events((await c.post("/v1/chat/completions", json=chat_body(stream=True), headers=h)).text)
    assert {e["id"] for e in evs} == {"chatcmpl-hdr-1"}
    d = (await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=h)).json()
    assert d["id"] == "cmpl-hdr-1"
    assert not any("hdr" in r.request_id for r in orch.requests)     # the pipeline's ids stay its own


@pytest.mark.parametrize("rid", ["", "has space", "x" * 257])
async def test_an_x_request_id_that_is_no_id_is_passed_over_not_refused(tokenizer, rid):  # noqa: F811
    """Proxies and tracing middleware set the header, not the client (vLLM takes any value): one that cannot
    be an answer's id gives the body's request_id or a fresh id, never a 400 for what the client never sent."""
    orch, c = make(tokenizer)
    h = {"X-Request-Id": rid}
    d = (await c.post("/v1/chat/completions", json=chat_body(request_id="body-2"), headers=h)).json()
    assert d["id"] == "chatcmpl-body-2"
    d = (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=h)).json()
    assert d["id"].startswith("cmpl-") and d["id"] != f"cmpl-{rid}" and len(d["id"]) < 100
