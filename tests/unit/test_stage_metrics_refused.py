"""vllm-omni's `return_stage_metrics` (per-stage `metrics` in the answer; its benchmarks send it) is refused by
name when true, on chat as on speech; chat ignored it and answered without them."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
WHY = "per-stage metrics are on /metrics and in `omni status`"


async def test_chat_refuses_return_stage_metrics_by_name(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    for body in (chat_body(return_stage_metrics=True), chat_body(return_stage_metrics=True, stream=True)):
        assert_error(await c.post("/v1/chat/completions", json=body), 400, param="return_stage_metrics", contains=WHY)
    for off in (False, None):   # the no-op values pass
        assert (await c.post("/v1/chat/completions", json=chat_body(return_stage_metrics=off))).status_code == 200
    # a chat job is checked as chat is
    job = {"endpoint": "/v1/chat/completions", "body": chat_body(return_stage_metrics=True)}
    assert_error(await c.post("/v1/omni/jobs", json=job), 400, contains="return_stage_metrics")


async def test_speech_still_refuses_it(tokenizer):  # noqa: F811
    _, c = make(tokenizer, speech_entry_stage=1)
    body = {"model": "tiny", "input": "hi", "return_stage_metrics": True}
    assert_error(await c.post("/v1/audio/speech", json=body), 400, param="return_stage_metrics")
