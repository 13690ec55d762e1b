"""benchmarks/serve.py counts completion tokens from the usage chunk (as vLLM's bench client), not
chunks with text, and reports no percentile for a level with no samples rather than nan."""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks import serve

pytestmark = pytest.mark.anyio


def chat_stream(bodies: list) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": ""}}]},            # a token whose text is held back
                  {"choices": [{"delta": {"content": "Hello wor"}}]},   # it and two more tokens' text
                  {"choices": [{"delta": {"content": "ld"}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


async def test_tokens_are_the_usage_chunks_completion_tokens():
    bodies: list = []
    async with httpx.AsyncClient(transport=chat_stream(bodies)) as c:
        ttft, e2e, tokens = await serve.one(c, "http://t", "hi", 5)
    assert tokens == 5 and ttft is not None and e2e >= ttft
    assert bodies[0]["stream_options"] == {"include_usage": True}


def test_a_level_without_any_text_has_no_ttft_percentiles_not_nan():
    r = serve.row(1, [(None, 0.5, 4), (None, 1.5, 4)], 2.0, {})
    assert (r["ttft_p50_ms"], r["ttft_p99_ms"]) == (None, None)
    assert (r["e2e_p50_ms"], r["tokens"], r["throughput_tok_s"]) == (1000.0, 8, 4.0)
