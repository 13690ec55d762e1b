"""A request pipelined behind one whose connection ends (omni/api/http1.py): h11 holds the second request
PAUSED until the first response is DONE, and Hypercorn's reader waited for a wake-up that never came once
the connection ended, so the connection's task lived for the process's life and a stop waited out its
whole grace. Real Hypercorn on 127.0.0.1:0, raw client sockets; the server's connection task is the one
asyncio runs Hypercorn's accept callback in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import numpy as np
import pytest

from omni.api import build_app
from omni.api.limits import HttpLimits
from omni.api.serve import serve
from omni.orchestrator.types import PipelineOutput
from tests.unit.api_fakes import FakeOrchestrator, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
SECOND = b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n"


class EndlessAudio(FakeOrchestrator):
    async def generate(self, request):
        pcm = np.zeros(16384, dtype="<f4").tobytes()
        while True:
            yield PipelineOutput(request_id=request.request_id, stage_id=1, modality="audio", audio_pcm=pcm,
                                 sample_rate=24000)
            await asyncio.sleep(0.005)


def speech(fmt: dict) -> bytes:
    payload = json.dumps({"model": "tiny", "input": "hello there", **fmt}).encode()
    return (b"POST /v1/audio/speech HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload)


def connection_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if "_server_callback" in repr(t.get_coro())}


@contextlib.asynccontextmanager
async def served(tok, limits: HttpLimits, grace: float):
    """-> (port, stop event, server task); the server is stopped at the end if the test did not."""
    app = build_app(EndlessAudio(tok), tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    limits=limits)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       graceful_timeout=grace, limits=limits))
    try:
        yield await asyncio.wait_for(ready, 10), stop, server
    finally:
        stop.set()
        await asyncio.wait_for(server, grace + 10)


async def pipelined_client(port: int, fmt: dict, *, rcvbuf: int | None = None) -> socket.socket:
    """A client that sent a streaming speech request with a second request behind it and read the head
    (`rcvbuf`: and a receive window that fills soon after, as one that stops reading)."""
    loop = asyncio.get_running_loop()
    client = socket.socket()
    if rcvbuf:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)   # before connect: the window stays small
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", port))
    await loop.sock_sendall(client, speech(fmt) + SECOND)
    assert (await asyncio.wait_for(loop.sock_recv(client, 4096), 10)).startswith(b"HTTP/1.1 200")
    return client


async def test_a_client_that_leaves_mid_response_with_a_request_queued_ends_its_connection(tokenizer):
    async with served(tokenizer, HttpLimits(), grace=10.0) as (port, stop, server):
        clients = [await pipelined_client(port, {"stream_format": "audio", "response_format": "pcm"})
                   for _ in range(3)]
        tasks = connection_tasks()
        assert len(tasks) == 3
        for c in clients:
            c.close()
        _, alive = await asyncio.wait(tasks, timeout=10)
        assert not alive, f"{len(alive)} of 3 connections' tasks outlived their clients"
        stop.set()
        await asyncio.wait_for(server, 5)       # nothing left to wait for: not the 10 s grace


async def test_a_response_cut_by_the_write_timeout_with_a_request_queued_ends_its_connection(tokenizer):
    """The client stays connected and never reads: the write timeout ends the response, then the connection."""
    async with served(tokenizer, HttpLimits(timeout_response_write=0.5), grace=10.0) as (port, _, _):
        client = await pipelined_client(port, {"stream_format": "audio", "response_format": "pcm"}, rcvbuf=4096)
        try:
            tasks = connection_tasks()
            assert len(tasks) == 1
            _, alive = await asyncio.wait(tasks, timeout=10)
            assert not alive, "the cut connection's task still waits to read the queued request"
        finally:
            client.close()


async def test_a_stream_ended_by_the_stop_with_a_request_queued_does_not_hold_the_stop(tokenizer):
    """--shutdown-timeout 1: the stream ends whole (its speech.audio.error event) 1 s into the stop, Hypercorn's
    grace 1 s later; the queued request is not served, and its connection ends with the stream rather than
    being cancelled when the grace runs out."""
    loop = asyncio.get_running_loop()
    async with served(tokenizer, HttpLimits(shutdown_timeout=1), grace=1.0) as (port, stop, server):
        client = await pipelined_client(port, {"stream_format": "sse"})
        try:
            (task,) = connection_tasks()
            stop.set()
            got = bytearray()
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), 10):
                got += chunk
            assert got.endswith(b"0\r\n\r\n") and b"server_shutting_down" in got and b'"status"' not in got
            await asyncio.wait_for(server, 10)
            assert task.done() and not task.cancelled(), "the connection's task was cancelled at the grace's end"
        finally:
            client.close()
