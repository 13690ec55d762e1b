"""--timeout-response-write: a client that stops reading a streaming response ends it once one write
has waited that long, so the request is cancelled upstream (the orchestrator's iterator closed) instead
of being held until the client disconnects. A real Hypercorn server on 127.0.0.1:0 (the wait is in its
writer's drain()) and a raw client socket with a tiny receive buffer that never reads."""

from __future__ import annotations

import asyncio
import contextlib
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
    async with served(app, limits) as port:
        with socket.socket() as client:   # closed first: the peer leaves, Hypercorn's connection ends either way
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: the window stays small
            client.setblocking(False)
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
            payload = json.dumps(body).encode()
            await asyncio.get_running_loop().sock_sendall(client, b"POST /v1/audio/speech HTTP/1.1\r\nhost: localhost\r\n"
                                                          b"content-type: application/json\r\ncontent-length: "
                                                          + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            await asyncio.wait_for(orch.started_event.wait(), 10)
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(orch.closed_event.wait(), wait_s)
            except TimeoutError:
                return False, None
            return True, time.monotonic() - t0


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
    loop = asyncio.get_running_loop()
    async with served(app, limits) as port:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setblocking(False)
            await loop.sock_connect(client, ("127.0.0.1", port))
            payload = json.dumps({"model": "tiny", "input": "hello there", "stream_format": "audio",
                                  "response_format": "pcm"}).encode()
            await loop.sock_sendall(client, b"POST /v1/audio/speech HTTP/1.1\r\nhost: localhost\r\ncontent-type: "
                                    b"application/json\r\ncontent-length: " + str(len(payload)).encode()
                                    + b"\r\n\r\n" + payload)
            assert (await asyncio.wait_for(loop.sock_recv(client, 4096), 10)).startswith(b"HTTP/1.1 200")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()                                    # RST, with the rest of the backlog still queued
            await asyncio.wait_for(orch.closed_event.wait(), 10)
            assert orch.yielded < Backlog.N // 2, f"{orch.yielded} of {Backlog.N} outputs sent into a reset connection"


class BigSpeech(FakeOrchestrator):
    """A finite speech whose whole body (a 16 MiB WAV) is more than the socket buffers and asyncio's take."""

    async def generate(self, request):
        self.started_event.set()
        pcm = np.zeros(1 << 20, dtype="<f4").tobytes()
        for _ in range(8):
            yield PipelineOutput(request_id=request.request_id, stage_id=1, modality="audio", audio_pcm=pcm,
                                 sample_rate=24000)
        self.closed_event.set()


async def _whole_body(tok, caplog, write_s: float, read_every_s: float | None) -> tuple[int, int, bool, bool]:
    """A non-streaming speech request from a client that reads nothing for 3 s, then reads for 5 s (read_every_s
    None: a tiny receive buffer, so the server's send waits), or that pauses read_every_s after each 256 KiB
    (the kernel's buffers: a tiny window stalls TCP itself); -> (body bytes read, Content-Length, whether
    the connection ended, whether the write timeout was logged)."""
    limits = HttpLimits(timeout_response_write=write_s)
    app = build_app(BigSpeech(tok), tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    limits=limits)
    loop = asyncio.get_running_loop()
    async with served(app, limits) as port:
        with socket.socket() as client:
            if read_every_s is None:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setblocking(False)
            await loop.sock_connect(client, ("127.0.0.1", port))
            payload = json.dumps({"model": "tiny", "input": "hello there", "response_format": "wav"}).encode()
            await loop.sock_sendall(client, b"POST /v1/audio/speech HTTP/1.1\r\nhost: localhost\r\ncontent-type: "
                                    b"application/json\r\ncontent-length: " + str(len(payload)).encode()
                                    + b"\r\n\r\n" + payload)
            if read_every_s is None:
                await asyncio.sleep(3)      # the client reads nothing: the write timeout passes several times over
            got, ended, head = await read_response(client, 5 if read_every_s is None else 30, read_every_s)
            logged = any("--timeout-response-write" in r.getMessage() for r in caplog.records)
            return len(got) - head - 4, length(got[:head]), ended, logged


@contextlib.asynccontextmanager
async def served(app, limits: HttpLimits, stop: asyncio.Event | None = None):
    """The port of `app` served by omni's Hypercorn as a task on this loop; stopped (grace 1 s unless
    limits.shutdown_timeout says) at the exit, or earlier by setting `stop`."""
    stop = asyncio.Event() if stop is None else stop
    ready = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(app, shutdown_event=stop, on_ready=lambda h, p: ready.set_result(p),
                                       graceful_timeout=1.0, limits=limits))
    try:
        yield await asyncio.wait_for(ready, 10)
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)


def length(head: bytes) -> int:
    found = [line for line in bytes(head).split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return int(found[0].split(b":")[1])


async def read_response(client: socket.socket, within_s: float, read_every_s: float | None = None):
    """(bytes read, whether the server ended the connection, the head's end) of one HTTP response read
    from `client` for at most `within_s`; `read_every_s`: a pause after each 256 KiB (a slow reader)."""
    loop = asyncio.get_running_loop()
    got, ended, head = bytearray(), False, -1   # bytes += would copy the body at every read
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(client, 64 * 1024), deadline - time.monotonic())
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            break
        if not chunk:
            ended = True
            break
        got += chunk
        head = got.find(b"\r\n\r\n") if head < 0 else head
        if head >= 0 and len(got) - head - 4 >= length(got[:head]):
            break                   # the whole body
        if read_every_s is not None and len(got) // (256 * 1024) > (len(got) - len(chunk)) // (256 * 1024):
            await asyncio.sleep(read_every_s)
    return got, ended, head


async def test_a_whole_body_the_client_does_not_take_ends_its_connection(tokenizer, caplog):
    """--timeout-response-write covered streams only: a whole body (a speech WAV, a chat JSON with logprobs)
    a client never read held its connection and Hypercorn's buffered copy of it until the client left."""
    with caplog.at_level(logging.INFO):
        read, declared, ended, logged = await _whole_body(tokenizer, caplog, WRITE_S, None)
    assert declared == 44 + 8 * 2 * (1 << 20)
    assert ended and logged and read < declared, f"{read} of {declared} bytes, ended {ended}: the stalled " \
                                                 "response was not ended"


async def test_a_slow_reader_of_a_whole_body_gets_all_of_it(tokenizer, caplog):
    """The deadline is on each 64 KiB piece, not on the whole body: a client that keeps reading, for longer
    than the timeout in all, is not cut off."""
    with caplog.at_level(logging.INFO):
        t0 = time.monotonic()
        read, declared, ended, logged = await _whole_body(tokenizer, caplog, 1.0, 0.05)
    assert time.monotonic() - t0 > 1.0
    assert (read, ended, logged) == (declared, False, False)
