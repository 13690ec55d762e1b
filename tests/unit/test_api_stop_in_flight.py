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
from omni.api.serve import serve
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401 (fixture)

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


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body()),
    ("/v1/chat/completions", chat_body(stream=True)),    # before its first chunk: no stream yet
    ("/v1/completions", {"model": "tiny", "prompt": "say hello"}),
    ("/v1/audio/speech", {"model": "tiny", "input": "hello"}),
    ("/v1/audio/speech", {"model": "tiny", "input": "hello", "stream": True}),
], ids=["chat", "chat-stream", "completions", "speech", "speech-sse"])
async def test_a_request_unanswered_when_the_drain_ends_is_a_503_server_shutting_down(tokenizer, path, body):
    orch = Stalled(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       limits=HttpLimits(shutdown_timeout=0)))
    try:
        port = await asyncio.wait_for(ready, 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            answer = asyncio.create_task(c.post(path, json=body))
            await asyncio.wait_for(orch.started_event.wait(), 10)
            stop.set()
            r = await asyncio.wait_for(answer, 10)
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json() == {"error": {"message": "server shutting down", "type": "service_unavailable", "param": None,
                                  "code": "server_shutting_down"}}
    assert orch.closed == [orch.requests[0].request_id], "the request was not cancelled in its stages"
    assert not app.state.in_flight


async def test_a_request_answered_within_the_drain_is_whole(tokenizer):
    orch = Held(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       limits=HttpLimits(shutdown_timeout=5)))
    try:
        port = await asyncio.wait_for(ready, 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            answer = asyncio.create_task(c.post("/v1/chat/completions", json=chat_body()))
            await asyncio.wait_for(orch.started_event.wait(), 10)
            stop.set()
            orch.release.set()          # the stage answers during the drain
            r = await asyncio.wait_for(answer, 10)
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert r.status_code == 200, r.text
