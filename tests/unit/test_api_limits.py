"""The frontend's own bounds (omni/api/limits.py, state.check_prompt_chars, job and voice caps),
driven over ASGI with hand-made receive/send so what the app reads is visible."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from omni.api import build_app
from omni.api import voices as voices_mod
from omni.api.jobs import Jobs, LocalKv, Results
from omni.api.limits import HttpLimits
from omni.errors import BadRequest, ConfigError
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_jobs import settle

pytestmark = pytest.mark.anyio


def app_with(tokenizer, **limits):
    return build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                     limits=HttpLimits(**limits))


async def drive(app, headers: list, chunks, *, hang: bool = False, timeout: float = 10.0):
    """POST /v1/completions; receive hands out `chunks` (then hangs if `hang`). Returns
    (status, body, how many chunks the app read)."""
    reads = 0
    sent: list = []

    async def receive():
        nonlocal reads
        if reads < len(chunks):
            reads += 1
            return {"type": "http.request", "body": chunks[reads - 1], "more_body": hang or reads < len(chunks)}
        await asyncio.Event().wait()   # a client that sends nothing more

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "client": None, "server": None, "headers": [(b"content-type", b"application/json"), *headers]}
    await asyncio.wait_for(app(scope, receive, send), timeout)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), reads


async def test_declared_body_over_the_cap_is_refused_unread(tokenizer):
    app = app_with(tokenizer, max_request_bytes=4096)
    status, body, reads = await drive(app, [(b"content-length", b"500000000")], [b"x" * 4096])
    assert status == 413 and reads == 0, (status, body, reads)
    assert "500000000 bytes" in body["error"]["message"] and "--max-request-bytes" in body["error"]["message"]


async def test_chunked_body_is_cut_off_at_the_cap(tokenizer):
    app = app_with(tokenizer, max_request_bytes=4096)
    status, body, reads = await drive(app, [], [b" " * 3000] * 50)
    assert status == 413 and reads == 2, (status, body, reads)   # the second chunk passes the cap
    assert body["error"]["code"] == "request_too_large"


async def test_a_body_that_stops_arriving_is_408(tokenizer):
    app = app_with(tokenizer, timeout_request_body=0.2)
    status, body, _ = await drive(app, [], [b'{"prompt":'], hang=True)
    assert status == 408 and "--timeout-request-body" in body["error"]["message"], body


async def test_a_body_under_the_cap_is_served(tokenizer):
    app = app_with(tokenizer, max_request_bytes=4096)
    payload = json.dumps({"model": "tiny", "prompt": "say hello", "max_tokens": 4}).encode()
    status, body, _ = await drive(app, [(b"content-length", str(len(payload)).encode())],
                                  [payload[:10], payload[10:]])
    assert status == 200 and body["choices"][0]["text"], body


@pytest.mark.parametrize("field,value", [("max_request_bytes", 10), ("timeout_keep_alive", 0),
                                         ("timeout_request_body", -1), ("timeout_response_write", 0.05),
                                         ("backlog", 0)])
def test_bad_limits_name_the_flag(field, value):
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        HttpLimits(**{field: value})


async def test_a_prompt_that_cannot_fit_is_refused_untokenized(tokenizer):
    app = app_with(tokenizer)
    fe = app.state.frontend
    assert fe.max_chars_per_token > 0
    huge = "hello world " * (128 * fe.max_chars_per_token // 12 + 1)

    def never(*a):
        raise AssertionError("tokenized a prompt that cannot fit")
    fe.encode = never
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                                  ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": huge}]),
                                   "messages"),
                                  ("/tokenize", {"prompt": huge}, "prompt")):
            r = await c.post(path, json=body)
            assert_error(r, 400, param, "maximum context length is 128 tokens")
        r = await c.post("/v1/completions", json={"prompt": list(range(200))})   # ids: length before range checks
        assert_error(r, 400, None, "maximum context length is 128")


async def test_unknown_model_name_is_echoed_cut(tokenizer):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_with(tokenizer)), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=chat_body(model="m" * 100_000))
    err = assert_error(r, 404, "model", "100000 characters")
    assert len(err["message"]) < 400


class SmallKv(LocalKv):
    """A KV that refuses values over `limit` bytes, as the master does (64 KiB)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    async def kv_put(self, namespace, key, value, only_if_exists=False):
        if len(value) > self.limit:
            raise BadRequest(f"value for {namespace}/{key} is {len(value)} bytes; the limit is {self.limit}")
        return await super().kv_put(namespace, key, value, only_if_exists)


async def test_a_job_error_is_cut_to_fit_the_kv(tokenizer, tmp_path):
    jobs = Jobs(SmallKv(64 << 10), Results(tmp_path))
    orch = FakeOrchestrator(tokenizer)
    # a stage's error echoing a long field (an unknown model is refused at submit now: 811aebf)
    orch.fail = BadRequest("the stage says: " + "m" * 1_500_000)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, jobs=jobs)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()})
        assert r.status_code == 200, r.text
        await settle(jobs)
        job = (await c.get(f"/v1/omni/jobs/{r.json()['id']}")).json()
        assert job["status"] == "failed" and job["error"]["type"] == "invalid_request_error", job
        assert len(job["error"]["message"]) < 64 << 10, len(job["error"]["message"])
        listed = await c.get("/v1/omni/jobs")
        assert listed.status_code == 200 and listed.json()["data"][0]["id"] == job["id"]


async def test_a_record_the_kv_refuses_is_stored_as_its_queued_record_failed(tokenizer, tmp_path):
    orch = FakeOrchestrator(tokenizer)
    orch.fail = BadRequest("the stage says: " + "x" * 50_000)
    jobs = Jobs(SmallKv(2000), Results(tmp_path))   # the error, cut to MAX_ERROR_CHARS, is still too big
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, jobs=jobs)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()})
        await settle(jobs)
        job = (await c.get(f"/v1/omni/jobs/{r.json()['id']}")).json()
    # The fallback (1f63442) is the job's queued record marked failed, which the master takes at its limit.
    assert job["status"] == "failed" and job["error"]["code"] == "record_refused", job
    assert "refused its final record" in job["error"]["message"], job


async def test_voice_count_is_capped_naming_the_limit(tokenizer, monkeypatch):
    monkeypatch.setattr(voices_mod, "MAX_VOICES", 2)
    app = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                    speech_entry_stage=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for name in ("a", "b"):
            assert (await c.post("/v1/audio/voices", json={"name": name})).status_code == 201
        r = await c.post("/v1/audio/voices", json={"name": "c"})
        err = assert_error(r, 400, "name", "2 voices, the limit")
        assert err["code"] == "voice_limit_reached"
        assert (await c.delete("/v1/audio/voices/a")).status_code == 200
        assert (await c.post("/v1/audio/voices", json={"name": "c"})).status_code == 201


async def test_a_full_job_store_is_a_400_naming_the_limit(tokenizer, tmp_path):
    import grpc

    from omni.master.errors import KV_FULL, from_rpc_error

    class Full(grpc.RpcError):   # as the master sends a full namespace: marked as the KV's
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "kv namespace 'jobs' holds 10000 entries, the limit; delete some"

        def trailing_metadata(self):
            return (KV_FULL,)

    class FullKv(LocalKv):
        async def kv_put(self, namespace, key, value, only_if_exists=False):
            raise from_rpc_error(Full(), "127.0.0.1:1")

    jobs = Jobs(FullKv(), Results(tmp_path))
    app = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128, jobs=jobs)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()})
    assert_error(r, 400, None, "10000 entries, the limit")
