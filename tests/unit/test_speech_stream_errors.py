"""A speech stream that fails after its headers went out: the SSE form ends with vllm-omni's
speech.audio.error event, the raw form ends without its last chunk; one log line, no traceback."""

import json
import logging

import numpy as np
import pytest

from omni.errors import StageFailed
from omni.orchestrator.types import PipelineOutput
from tests.unit.api_fakes import make, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


def _dies_after(orch, n: int, prompt_tokens: int | None = 7):
    """The pipeline sends `n` audio chunks, then its code2wav replica is gone."""
    async def generate(request):
        orch.requests.append(request)
        for _ in range(n):
            yield PipelineOutput(request_id=request.request_id, stage_id=2, modality="audio",
                                 audio_pcm=np.full(100, 0.5, dtype="<f4").tobytes(), sample_rate=22050,
                                 num_prompt_tokens=prompt_tokens)
        raise StageFailed(2, "s2r0", "replica is gone", "unavailable")
    orch.generate = generate


def _events(text: str) -> list[dict]:
    return [json.loads(f[6:]) for f in text.split("\n\n") if f]


async def test_sse_speech_failing_part_way_ends_with_a_speech_audio_error_event(tokenizer, caplog):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    _dies_after(orch, 2)
    with caplog.at_level(logging.INFO):
        r = await c.post("/v1/audio/speech", json={"input": "hi there", "stream": True, "response_format": "pcm"})
    assert r.status_code == 200
    evs = _events(r.text)
    assert [e["type"] for e in evs] == ["speech.audio.delta"] * 2 + ["speech.audio.error"]
    err = evs[-1]["error"]
    assert err["type"] == "service_unavailable" and "replica is gone" in err["message"]
    assert err["partial_audio"] is True and err["action"] == "discard"
    problems = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(problems) == 1 and problems[0].levelno == logging.WARNING and not problems[0].exc_info


async def test_raw_speech_failing_part_way_ends_without_the_last_chunk_and_no_traceback(tokenizer, caplog):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    _dies_after(orch, 2)
    app = c._transport.app
    body = json.dumps({"input": "hi there", "stream_format": "audio", "response_format": "pcm"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech", "root_path": "", "query_string": b"",
             "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent, asked = [], []

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await __import__("asyncio").Event().wait()

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)     # before: StageFailed escaped to the server (its traceback)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 2 and all(m["more_body"] for m in bodies)    # two chunks, never a final one
    problems = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(problems) == 1 and "replica is gone" in problems[0].getMessage() and not problems[0].exc_info


async def test_speech_audio_done_carries_usage(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 2
    evs = _events((await c.post("/v1/audio/speech", json={"input": "hi", "stream_format": "sse"})).text)
    assert evs[-1]["type"] == "speech.audio.done"
    usage = evs[-1]["usage"]
    assert usage["audio_duration_s"] == pytest.approx(200 / 22050, abs=1e-6) and usage["audio_ttfp_s"] >= 0
    _dies_after(orch, 0, prompt_tokens=None)

    async def ok(request):      # as the speech stage reports its input's count on its outputs
        yield PipelineOutput(request_id=request.request_id, stage_id=2, modality="audio", finished=True,
                             audio_pcm=np.zeros(50, dtype="<f4").tobytes(), sample_rate=22050, num_prompt_tokens=9)
    orch.generate = ok
    evs = _events((await c.post("/v1/audio/speech", json={"input": "hi", "stream_format": "sse"})).text)
    assert evs[-1]["usage"]["input_tokens"] == 9
