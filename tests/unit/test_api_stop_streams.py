"""A frontend's graceful stop (SIGINT/SIGTERM: serve()'s shutdown event) with streams open: Hypercorn lets
them run for its grace, then cancels them mid-body. Now an SSE stream still open a second before the grace
ends gets its route's error event (chat: OpenAI-style and [DONE]; speech: speech.audio.error) and its request
is cancelled in its stages; a raw audio stream is left cut (no last chunk), so a truncated WAV does not pass
for a whole one. A real Hypercorn server, but for the stop racing a stream's last event."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from omni.api import build_app, sse
from omni.api.http import OPEN_STREAMS, STOPPING, ClosingStream, end_streams
from omni.api.serve import serve
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
GRACE_S = 1.5     # open streams are ended at GRACE_S - 1


async def _stop_during(orch, path: str, body: dict) -> tuple[list[str], BaseException | None, float]:
    """Stream `body`; once a first piece arrived, stop the server. The lines read, how the read ended
    (None: a complete response) and how long after the stop it did."""
    app = build_app(orch, orch.tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       graceful_timeout=GRACE_S))
    data = b""
    error = None
    try:
        port = await asyncio.wait_for(ready, 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            async with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                t_stop = None
                try:
                    async for piece in r.aiter_bytes():
                        data += piece
                        if t_stop is None:
                            stop.set()
                            t_stop = asyncio.get_running_loop().time()
                except httpx.HTTPError as e:
                    error = e
                took = asyncio.get_running_loop().time() - t_stop
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    return data.decode("latin-1").split("\n"), error, took


async def test_an_open_sse_stream_ends_with_an_error_event_and_done_at_the_stop(tokenizer):
    orch = FakeOrchestrator(tokenizer, reply="hello world again and again")
    orch.hang_after = 2          # two tokens, then the stage produces nothing more
    lines, error, took = await _stop_during(orch, "/v1/chat/completions", chat_body(stream=True))
    assert error is None, f"the stream was cut: {error!r}; read {lines}"
    events = [ln for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last == {"error": {"message": "server shutting down", "type": "service_unavailable", "param": None,
                              "code": "server_shutting_down"}}, events[-2]
    assert took < GRACE_S, took            # ended before Hypercorn's grace ran out
    assert orch.closed, "the request was not cancelled upstream"


async def test_a_stream_that_ends_within_the_grace_ends_whole(tokenizer):
    orch = FakeOrchestrator(tokenizer)
    lines, error, _ = await _stop_during(orch, "/v1/chat/completions", chat_body(stream=True))
    events = [ln for ln in lines if ln.startswith("data: ")]
    assert error is None and events[-1] == "data: [DONE]"
    assert not any("server shutting down" in e for e in events), events


class Hanging(FakeOrchestrator):
    async def generate(self, request):
        async for out in super().generate(request):
            yield out
            await asyncio.Event().wait()     # one chunk, then nothing


async def test_a_speech_sse_stream_ends_with_its_own_error_event_and_no_done(tokenizer):
    h = Hanging(tokenizer)
    h.audio_chunks = 3
    lines, error, took = await _stop_during(h, "/v1/audio/speech", {"model": "tiny", "input": "hello",
                                                                    "stream_format": "sse"})
    assert error is None, f"the stream was cut: {error!r}; read {lines}"
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]   # before: a [DONE] line failed here
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.error"], events
    # the audio that went out is not the answer: the shape a stage failure part-way has
    assert events[-1]["error"] == {"message": "server shutting down", "type": "service_unavailable", "param": None,
                                   "code": "server_shutting_down", "partial_audio": True, "action": "discard"}
    assert took < GRACE_S, took
    assert h.closed, "the request was not cancelled upstream"


async def _stop_while_sending(body, *, stopping) -> list:
    """A slow client: the body's second chunk sits in the send when the server's stop comes."""
    streams, sent, never, draining = set(), [], asyncio.Event(), asyncio.Event()

    async def send(msg):
        sent.append(msg)
        if len(sent) == 3:           # the head, the first chunk, then this one is still draining
            draining.set()
            await never.wait()

    async def receive():
        await never.wait()

    stream = ClosingStream(body, media_type="text/event-stream", stopping=stopping)
    task = asyncio.create_task(stream({"type": "http", "path": "/v1/x", OPEN_STREAMS: streams}, receive, send))
    await asyncio.wait_for(draining.wait(), 5)
    assert end_streams(streams) == 1
    await asyncio.wait_for(task, 5)
    return [(m.get("body"), m.get("more_body")) for m in sent[1:]]


async def test_a_stop_while_the_last_event_drains_ends_the_stream_as_it_is():
    async def chat():
        yield b"data: 1\n\n"
        yield sse.DONE

    # before: STOPPING followed the [DONE] (a second [DONE])
    assert await _stop_while_sending(chat(), stopping=STOPPING) == [
        (b"data: 1\n\n", True), (sse.DONE, True), (b"", False)]

    async def unfinished():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"       # not a closing event: the stop still says why it ended

    assert await _stop_while_sending(unfinished(), stopping=STOPPING) == [
        (b"data: 1\n\n", True), (b"data: 2\n\n", True), (STOPPING, False)]


async def test_a_raw_audio_stream_is_left_cut_not_ended_clean(tokenizer):
    h = Hanging(tokenizer)
    h.audio_chunks = 3
    body = {"model": "tiny", "input": "hello", "stream_format": "audio", "response_format": "pcm"}
    _, error, took = await _stop_during(h, "/v1/audio/speech", body)
    assert isinstance(error, httpx.RemoteProtocolError), error   # the client can tell it was cut
    assert took < GRACE_S + 0.5, took
    assert h.closed


def test_chat_and_speech_end_a_stopped_stream_with_one_error():
    """One definition: chat's error event and speech's speech.audio.error carry the same error."""
    from omni.api import speech
    from omni.api.http import SHUTTING_DOWN

    assert speech.SHUTTING_DOWN is SHUTTING_DOWN
    chat_error = json.loads(STOPPING.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert chat_error == {"message": SHUTTING_DOWN.message, "type": SHUTTING_DOWN.type, "param": None,
                          "code": SHUTTING_DOWN.code}
