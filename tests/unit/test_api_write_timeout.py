"""--timeout-response-write: a client that stops reading a streaming response ends it once one write
has waited that long, so the request is cancelled upstream (the orchestrator's iterator closed) instead
of being held until the client disconnects. A real Hypercorn server on 127.0.0.1:0 (the wait is in its
writer's drain()) and a raw client socket with a tiny receive buffer that never reads."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time

import numpy as np
import pytest

from omni.api import build_app
from omni.api.limits import HttpLimits
from omni.api.serve import serve
from omni.orchestrator.types import PipelineOutput
from tests.unit.api_fakes import FakeOrchestrator, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
WRITE_S = 0.5


@pytest.fixture
def anyio_backend():
    return "asyncio"


class EndlessAudio(FakeOrchestrator):
    """Audio chunks of 128 KiB (as s16le) for as long as they are taken; each waits a loop turn, as a
    real stage's output does (after a reset, Hypercorn's send returns at once without yielding)."""

    async def generate(self, request):
        self.started_event.set()
        pcm = np.zeros(65536, dtype="<f4").tobytes()
        try:
            while True:
                yield PipelineOutput(request_id=request.request_id, stage_id=1, modality="audio", audio_pcm=pcm,
                                     sample_rate=24000)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.request_id)
            self.closed_event.set()


async def _stalled_stream(tok, limits: HttpLimits, body: dict, wait_s: float):
    """Serve, send one streaming request from a socket that never reads; True when the request was
    cancelled upstream within `wait_s` of its start."""
    orch = EndlessAudio(tok)
    app = build_app(orch, tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1, limits=limits)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       graceful_timeout=1.0, limits=limits))
    client = socket.socket()
    try:
        port = await asyncio.wait_for(ready, 10)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: the window stays small
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
        payload = json.dumps(body).encode()
        await asyncio.get_running_loop().sock_sendall(client, b"POST /v1/audio/speech HTTP/1.1\r\nhost: t\r\n"
                                                      b"content-type: application/json\r\ncontent-length: "
                                                      + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await asyncio.wait_for(orch.started_event.wait(), 10)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(orch.closed_event.wait(), wait_s)
        except TimeoutError:
            return False, None
        return True, time.monotonic() - t0
    finally:
        client.close()   # the peer leaves: Hypercorn's connection ends either way
        stop.set()
        await asyncio.wait_for(server, 10)


@pytest.mark.parametrize("fmt", [{"stream_format": "audio", "response_format": "pcm"}, {"stream_format": "sse"}])
async def test_a_client_that_stops_reading_is_cut_off_and_its_request_cancelled(tokenizer, caplog, fmt):
    body = {"model": "tiny", "input": "hello there", **fmt}
    with caplog.at_level(logging.INFO, logger="omni.api.http"):
        cancelled, took = await _stalled_stream(tokenizer, HttpLimits(timeout_response_write=WRITE_S), body,
                                                WRITE_S + 10)
    assert cancelled, "the stalled stream still held its request"
    assert took < WRITE_S + 10
    lines = [r.getMessage() for r in caplog.records if r.name == "omni.api.http"]
    assert any("/v1/audio/speech" in m and "--timeout-response-write" in m and "0.5 s" in m for m in lines), lines


async def test_a_stalled_reader_is_held_while_the_write_timeout_runs(tokenizer):
    """The timeout ends the response, not the client's first pause: with 30 s, 2 s of not reading keeps it."""
    body = {"model": "tiny", "input": "hello there", "stream_format": "audio", "response_format": "pcm"}
    cancelled, _ = await _stalled_stream(tokenizer, HttpLimits(timeout_response_write=30), body, 2)
    assert not cancelled


class Backlog(FakeOrchestrator):
    """N audio outputs already queued (the orchestrator's generate() takes queued ones without awaiting)."""

    N = 4000

    def __init__(self, tok):
        super().__init__(tok)
        self.yielded = 0

    async def generate(self, request):
        self.started_event.set()
        pcm = np.zeros(1024, dtype="<f4").tobytes()
        try:
            for _ in range(self.N):
                self.yielded += 1
                yield PipelineOutput(request_id=request.request_id, stage_id=1, modality="audio", audio_pcm=pcm,
                                     sample_rate=24000)
        finally:
            self.closed_event.set()


async def test_a_reset_connection_stops_a_stream_with_outputs_queued(tokenizer):
    """After a reset Hypercorn's send returns at once without a loop turn, so the disconnect watch never
    ran and every queued output was converted and 'sent' into the closed connection, the loop held meanwhile."""
    orch = Backlog(tokenizer)
    limits = HttpLimits()
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    limits=limits)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       graceful_timeout=1.0, limits=limits))
    client = socket.socket()
    try:
        loop = asyncio.get_running_loop()
        port = await asyncio.wait_for(ready, 10)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", port))
        payload = json.dumps({"model": "tiny", "input": "hello there", "stream_format": "audio",
                              "response_format": "pcm"}).encode()
        await loop.sock_sendall(client, b"POST /v1/audio/speech HTTP/1.1\r\nhost: t\r\ncontent-type: "
                                b"application/json\r\ncontent-length: " + str(len(payload)).encode()
                                + b"\r\n\r\n" + payload)
        assert (await asyncio.wait_for(loop.sock_recv(client, 4096), 10)).startswith(b"HTTP/1.1 200")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()                                    # RST, with the rest of the backlog still queued
        await asyncio.wait_for(orch.closed_event.wait(), 10)
        assert orch.yielded < Backlog.N // 2, f"{orch.yielded} of {Backlog.N} outputs sent into a reset connection"
    finally:
        client.close()
        stop.set()
        await asyncio.wait_for(server, 10)
