"""--timeout-response-write and downloads: GET /v1/omni/jobs/{id}/content (and /v1/videos/{id}/content, the same
Jobs.download) is a Starlette FileResponse of the result file. A real Hypercorn server and a raw client socket with
a tiny receive buffer: a client that takes nothing has the download ended; one that keeps reading gets all of it."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import numpy as np
import pytest

from omni.api import build_app
from omni.api.jobs import Jobs, LocalKv, Results
from omni.api.limits import HttpLimits
from omni.orchestrator.types import PipelineOutput
from tests.unit.api_fakes import FakeOrchestrator, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_api_write_timeout import length, read_response, served

pytestmark = pytest.mark.anyio


class BigSpeech(FakeOrchestrator):
    """A 16 MiB WAV: more than the socket buffers and asyncio's take."""

    async def generate(self, request):
        pcm = np.zeros(1 << 20, dtype="<f4").tobytes()
        for _ in range(8):
            yield PipelineOutput(request_id=request.request_id, stage_id=1, modality="audio", audio_pcm=pcm,
                                 sample_rate=24000)


async def _download(tok, tmp_path, caplog, write_s: float, stall_s: float) -> tuple[int, int, bool, bool]:
    """A speech job's result downloaded by a client that reads nothing for `stall_s`, then reads for 5 s;
    -> (body bytes read, Content-Length, whether the connection ended, whether the write timeout was logged)."""
    limits = HttpLimits(timeout_response_write=write_s)
    jobs = Jobs(LocalKv(), Results(tmp_path))
    app = build_app(BigSpeech(tok), tok, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    jobs=jobs, limits=limits)
    loop = asyncio.get_running_loop()
    try:
        async with served(app, limits) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                job = (await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": {
                    "model": "tiny", "input": "hello there", "response_format": "wav"}})).json()
                deadline = time.monotonic() + 30
                while (await c.get(f"/v1/omni/jobs/{job['id']}")).json()["status"] != "completed":
                    assert time.monotonic() < deadline, "the job did not complete"
                    await asyncio.sleep(0.1)
            with socket.socket() as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: the window stays small
                client.setblocking(False)
                await loop.sock_connect(client, ("127.0.0.1", port))
                request = f"GET /v1/omni/jobs/{job['id']}/content HTTP/1.1\r\nhost: localhost\r\n\r\n"
                await loop.sock_sendall(client, request.encode())
                await asyncio.sleep(stall_s)
                got, ended, head = await read_response(client, 5)
                logged = any("--timeout-response-write" in r.getMessage() for r in caplog.records)
                return len(got) - head - 4, length(got[:head]), ended, logged
    finally:
        await jobs.close()


async def test_a_download_the_client_does_not_take_ends_its_connection(tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        read, declared, ended, logged = await _download(tokenizer, tmp_path, caplog, 0.5, 3)
    assert declared == 44 + 8 * 2 * (1 << 20)
    assert ended and logged and read < declared, f"{read} of {declared} bytes, ended {ended}, logged {logged}"


async def test_a_download_read_after_a_pause_shorter_than_the_timeout_is_whole(tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        read, declared, ended, logged = await _download(tokenizer, tmp_path, caplog, 30, 1)
    assert (read, ended, logged) == (declared, False, False)
