"""usage.prompt_tokens is the prompt as the engine saw it: vLLM's thinker expands each audio placeholder
to the audio tower's length and reports that (PipelineOutput.num_prompt_tokens), as vLLM's own usage does.
The frontend's templated count is only the fallback of an engine that reports none."""

from __future__ import annotations

import re

import pytest

from tests.unit.api_fakes import chat_body, make, sse_events, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio

REPORTED = 500


def reporting(orch, first_only: bool = True):
    """The orchestrator's outputs carry the engine's prompt count (from the first on, or on the first only)."""
    plain = orch.generate

    async def generate(request):
        i = 0
        async for out in plain(request):
            if i == 0 or not first_only:
                out.num_prompt_tokens = REPORTED
            i += 1
            yield out

    orch.generate = generate


async def test_usage_counts_the_prompt_the_engine_reports(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    reporting(orch, first_only=False)
    r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] == REPORTED and u["total_tokens"] == REPORTED + u["completion_tokens"]
    r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.json()["usage"]["prompt_tokens"] == REPORTED
    text = (await c.get("/metrics")).text
    assert re.search(rf"^vllm:prompt_tokens_total\{{[^}}]*\}} {2 * REPORTED}$", text, re.M), text


async def test_streamed_usage_counts_it_from_the_first_chunk(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    reporting(orch)
    body = chat_body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    evs = sse_events((await c.post("/v1/chat/completions", json=body)).text)
    assert {e["usage"]["prompt_tokens"] for e in evs} == {REPORTED}


async def test_no_report_keeps_the_templated_count(tokenizer):  # noqa: F811
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.json()["usage"]["prompt_tokens"] == len(orch.requests[0].prompt_token_ids)


async def test_speech_counts_no_prompt_tokens(tokenizer):  # noqa: F811
    # a talker's prompt (phonemes) is no chat or completions prefill: vllm:prompt_tokens_total stays 0
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    reporting(orch, first_only=False)
    assert (await c.post("/v1/audio/speech", json={"input": "hi", "voice": "joe"})).status_code == 200
    text = (await c.get("/metrics")).text
    assert re.search(r"^vllm:prompt_tokens_total\{[^}]*\} 0$", text, re.M), text
