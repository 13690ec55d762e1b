"""A client that goes away: the orchestrator's stream is closed, in memory and through real Hypercorn
sockets (split from test_api.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import httpx
import pytest

from omni.api import build_app
from omni.api.http import ClosingStream
from omni.api.serve import bind_socket, serve

from tests.unit.api_fakes import (  # noqa: F401 (fixtures)
    FakeOrchestrator, anyio_backend, chat_body, make, sse_events, tokenizer)

pytestmark = pytest.mark.anyio


# ---- disconnect -> abort

async def _drive(app, body: dict, disconnect: asyncio.Event | None, on_send=None) -> list:
    """Call the ASGI app directly; `receive` reports a disconnect once `disconnect` is set."""
    sent: list = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        if disconnect is not None:
            await disconnect.wait()
        else:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)
        if on_send is not None and on_send(msg) == "block":
            await asyncio.Event().wait()  # a client that stopped reading, then went away

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
             "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "scheme": "http",
             "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("where", ["in_orchestrator", "in_send"])
async def test_disconnect_mid_stream_closes_orchestrator_stream(tokenizer, where):
    """The client leaves after the first content chunk, while the app waits on the orchestrator
    or on a send: either way the orchestrator's iterator is closed before the app returns."""
    orch = FakeOrchestrator(tokenizer, "hello world, the quick brown fox")
    if where == "in_orchestrator":
        orch.hang_after = 2
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    gone = asyncio.Event()

    def on_send(msg):
        b = msg.get("body", b"")
        if b'"content":"' in b and b'"content":""' not in b:
            gone.set()
            return "block" if where == "in_send" else None

    sent = await _drive(app, chat_body(stream=True), gone, on_send)
    assert sent[0]["status"] == 200 and gone.is_set()
    assert orch.closed == [orch.requests[0].request_id]


async def test_disconnect_non_streaming_and_before_first_output(tokenizer):
    for stream in (False, True):
        orch = FakeOrchestrator(tokenizer)
        orch.hang_after = 0  # nothing is ever produced
        app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
        gone = asyncio.Event()
        task = asyncio.create_task(_drive(app, chat_body(stream=stream), gone))
        await asyncio.wait_for(orch.started_event.wait(), 10)
        gone.set()
        await asyncio.wait_for(task, 10)
        assert orch.closed == [orch.requests[0].request_id]


async def test_a_stream_whose_cancel_was_swallowed_ends_at_its_next_chunk():
    """The disconnect's cancel is delivered once; code under the stream may swallow it (3.11's
    asyncio.wait_for did): the stream still stops before sending another chunk, and closes its body."""
    gone, closed = asyncio.Event(), asyncio.Event()

    async def body():
        try:
            yield "a"
            try:
                await asyncio.Event().wait()     # waiting for the next output when the client leaves
            except asyncio.CancelledError:
                pass                             # swallowed
            for i in range(100):                 # and outputs keep coming
                yield str(i)
        finally:
            closed.set()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def send(msg):
        sent.append(msg)
        if msg.get("body") == b"a":
            gone.set()

    async def stream():
        await ClosingStream(body())({"type": "http"}, receive, send)
        return asyncio.current_task().cancelling()

    assert await asyncio.wait_for(asyncio.create_task(stream()), 10) == 0   # no cancel left counted on the task
    assert [m.get("body") for m in sent] == [None, b"a"] and closed.is_set()


# ---- real sockets

async def test_hypercorn_streaming_and_disconnect(tokenizer):
    orch = FakeOrchestrator(tokenizer, "hello world, the quick brown fox")
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, frontend_index=2)
    stop = asyncio.Event()
    ready, ports = asyncio.Event(), []
    task = asyncio.create_task(serve(app, host="127.0.0.1", port=0, shutdown_event=stop,
                                     on_ready=lambda h, p: (ports.append(p), ready.set())))
    try:
        await _wait_ready(ready, task)
        port = ports[0]
        assert port > 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
                assert r.status_code == 200 and r.headers["x-omni-frontend"] == "2"
                body = "".join([chunk async for chunk in r.aiter_text()])
            content = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(body) if e["choices"])
            assert content == "hello world, the quick brown fox"

            orch.hang_after, orch.closed_event = 3, asyncio.Event()
            async with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break  # leave mid-stream: the connection closes
            await asyncio.wait_for(orch.closed_event.wait(), 10)
            assert orch.closed[-1] == orch.requests[-1].request_id
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_bind_socket_refuses_a_taken_port_and_serves_a_handed_socket(tokenizer):
    a = bind_socket("127.0.0.1", 0)
    with pytest.raises(OSError):
        bind_socket("127.0.0.1", a.getsockname()[1])   # no SO_REUSEPORT: nobody shares the port
    b = socket.socket(fileno=os.dup(a.fileno()))       # the launcher hands its listener by fd
    orch = FakeOrchestrator(tokenizer)
    stop = asyncio.Event()
    ready, ports = asyncio.Event(), []
    task = asyncio.create_task(serve(build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128),
                                     sock=b, shutdown_event=stop, on_ready=lambda h, p: (ports.append(p), ready.set())))
    try:
        await _wait_ready(ready, task)
        assert ports == [a.getsockname()[1]]
        a.close()  # b, the handed fd, still listens
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(f"http://127.0.0.1:{ports[0]}/health")
            assert r.status_code == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        b.close()


async def _wait_ready(ready: asyncio.Event, task: asyncio.Task) -> None:
    """Wait for on_ready, failing at once if the server task dies first."""
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({waiter, task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    assert ready.is_set(), task.exception() if task.done() else "server not ready within 10 s"
