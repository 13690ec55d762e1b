"""A job's pre-run work (a chat's templating and audio decoding, a completion's tokenizing) is done once: its
submit check's result is kept for its run (omni/api/job_prepared.py). Since 811aebf it ran at submit and again
at run, on the frontend's one tokenizer thread (~0.3 s each for a 16 MiB WAV body). At most MAX_PREPARED results
are kept; later jobs prepare again when they run, and a job that ends without running lets its result go."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from omni.api import build_app
from omni.api import jobs as J
from omni.api.jobs import Jobs, LocalKv, Results
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_audio_in import pcm_wav
from tests.unit.test_jobs import settle

pytestmark = pytest.mark.anyio

WAV = base64.b64encode(pcm_wav(np.zeros(1600), 16000, 2)).decode()
AUDIO_CHAT = chat_body(messages=[{"role": "user", "content": [
    {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}, {"type": "text", "text": "What?"}]}])


def counting(calls: dict, name: str, f):
    def counted(*a, **kw):
        calls[name] += 1
        return f(*a, **kw)
    return counted


@pytest.fixture
def app(tokenizer, tmp_path):  # noqa: F811
    orch = FakeOrchestrator(tokenizer)
    jobs = Jobs(LocalKv(), Results(str(tmp_path)))
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=512, jobs=jobs)
    fe = app.state.frontend
    fe.audio_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")   # takes audio
    calls = {"audio_inputs": 0, "render_chat": 0, "encode": 0}
    for name in calls:
        setattr(fe, name, counting(calls, name, getattr(fe, name)))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, jobs, orch, calls


async def test_a_chat_jobs_templating_and_audio_decoding_run_once(app):
    c, jobs, orch, calls = app
    r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": AUDIO_CHAT})
    assert r.status_code == 200, r.text
    await settle(jobs)
    job = (await c.get(f"/v1/omni/jobs/{r.json()['id']}")).json()
    assert job["status"] == "completed", job
    assert calls["audio_inputs"] == 1 and calls["render_chat"] == 1, calls     # 2 and 2 before
    assert len(orch.requests) == 1 and "audio_0" in orch.requests[0].inputs
    sync = await c.post("/v1/chat/completions", json=AUDIO_CHAT)
    got = await c.get(f"/v1/omni/jobs/{job['id']}/content")
    assert got.json()["choices"] == sync.json()["choices"]
    assert len(jobs._kept) == 0


async def test_a_completion_job_tokenizes_once(app):
    c, jobs, _, calls = app
    r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}})
    assert r.status_code == 200, r.text
    await settle(jobs)
    assert calls["encode"] == 1 and len(jobs._kept) == 0, calls


async def test_past_the_bound_a_job_prepares_again_and_no_result_outlives_its_job(app):
    c, jobs, _, calls = app
    n = J.MAX_PREPARED + 1
    jobs._slots = asyncio.Semaphore(0)         # every job waits queued until released
    ids = [(await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": AUDIO_CHAT})).json()["id"]
           for _ in range(n)]
    assert len(jobs._kept) == J.MAX_PREPARED and calls["audio_inputs"] == n
    for _ in range(n):
        jobs._slots.release()
    await settle(jobs)
    assert calls["audio_inputs"] == n + 1, calls    # only the job past the bound decoded its audio again
    assert len(jobs._kept) == 0
    assert [(await c.get(f"/v1/omni/jobs/{i}")).json()["status"] for i in ids] == ["completed"] * n
    jobs._slots = asyncio.Semaphore(0)
    ids = [(await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": AUDIO_CHAT})).json()["id"]
           for _ in range(n)]
    for job_id in ids:                          # deleted before they ran: their results go with them
        assert (await c.delete(f"/v1/omni/jobs/{job_id}")).status_code == 200
    await settle(jobs)
    assert len(jobs._kept) == 0 and not jobs._tasks
