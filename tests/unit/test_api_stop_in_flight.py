"""A frontend's stop (--shutdown-timeout's drain, or the grace) finding a request that has not begun to answer:
when the drain ends it is cancelled in its stages and answered 503 server_shutting_down in OpenAI's error shape.
Before, Hypercorn cancelled it at the end of its grace and sent its own bare 500 (content-length 0); only open
streams ended cleanly. A real Hypercorn server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from omni.api import build_app
from omni.api.limits import HttpLimits
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_api_write_timeout import served

pytestmark = pytest.mark.anyio


class Stalled(FakeOrchestrator):
    """Takes the request, then produces nothing until cancelled."""

    async def generate(self, request):
        self.requests.append(request)
        self.started_event.set()
        try:
            await asyncio.Event().wait()
            yield   # pragma: no cover (an async generator)
        finally:
            self.closed.append(request.request_id)
            self.closed_event.set()


class Held(FakeOrchestrator):
    """Answers once `release` is set."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.release = asyncio.Event()

    async def generate(self, request):
        self.started_event.set()
        await self.release.wait()
        async for out in super().generate(request):
            yield out


async def _stopped_while_answering(orch, path: str, body: dict, shutdown_timeout: int, during_drain=None):
    """POST `body` to `path` on a real server and begin its stop once the orchestrator has the request, then
    call `during_drain`; -> (the app, the answer)."""
    app = build_app(orch, orch.tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1)
    stop = asyncio.Event()
    async with served(app, HttpLimits(shutdown_timeout=shutdown_timeout), stop) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            answer = asyncio.create_task(c.post(path, json=body))
            await asyncio.wait_for(orch.started_event.wait(), 10)
            stop.set()
            if during_drain is not None:
                during_drain()
            r = await asyncio.wait_for(answer, 10)
    return app, r


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body()),
    ("/v1/chat/completions", chat_body(stream=True)),    # before its first chunk: no stream yet
    ("/v1/completions", {"model": "tiny", "prompt": "say hello"}),
    ("/v1/audio/speech", {"model": "tiny", "input": "hello"}),
    ("/v1/audio/speech", {"model": "tiny", "input": "hello", "stream": True}),
], ids=["chat", "chat-stream", "completions", "speech", "speech-sse"])
async def test_a_request_unanswered_when_the_drain_ends_is_a_503_server_shutting_down(tokenizer, path, body):
    orch = Stalled(tokenizer)
    app, r = await _stopped_while_answering(orch, path, body, 0)
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json() == {"error": {"message": "server shutting down", "type": "service_unavailable", "param": None,
                                  "code": "server_shutting_down"}}
    assert orch.closed == [orch.requests[0].request_id], "the request was not cancelled in its stages"
    assert not app.state.in_flight


async def test_a_request_answered_within_the_drain_is_whole(tokenizer):
    orch = Held(tokenizer)
    _, r = await _stopped_while_answering(orch, "/v1/chat/completions", chat_body(), 5,
                                          during_drain=orch.release.set)   # the stage answers during the drain
    assert r.status_code == 200, r.text
