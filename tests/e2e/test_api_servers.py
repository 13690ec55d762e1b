"""Issue 5: `--api-server-count 2` sharing one set of stage engines, state through the master."""

from __future__ import annotations

import json
import re
import io
import signal
import subprocess
import sys
import time
import wave

import httpx
import psutil
import pytest

from tests.e2e.harness import REPO, OmniProcess, omni_env, omni_shm_entries, pinned, until_frontend

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    p = OmniProcess("serve", MODEL, "--port", "0", "--api-server-count", "2")
    try:
        url = p.http(300)
        yield p, url, p.master_address()
    finally:
        # Ctrl-C, then the whole tree gone (a clean stop removes the launcher's temp dir and the stages' shm)
        assert omni_shm_entries(p.stop(60)) == []


def fresh(url: str, method: str, path: str, **kw) -> httpx.Response:
    """One request on a new connection (so the kernel picks a frontend anew)."""
    with httpx.Client(timeout=120) as c:
        return c.request(method, f"{url}{path}", **kw)


def test_connections_spread_over_both_frontends(server):
    _, url, _ = server
    seen = {fresh(url, "GET", "/v1/models").headers["x-omni-frontend"] for _ in range(60)}
    assert seen == {"0", "1"}


def test_both_frontends_answer_the_same_greedy_text(server):
    _, url, _ = server
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    a = until_frontend(url, "0", "POST", "/v1/chat/completions", json=body)
    b = until_frontend(url, "1", "POST", "/v1/chat/completions", json=body)
    assert a.status_code == b.status_code == 200
    text = a.json()["choices"][0]["message"]["content"]
    assert "Paris" in text and b.json()["choices"][0]["message"]["content"] == text


def test_status_and_metrics_count_requests_per_frontend(server):
    _, url, master = server
    deadline = time.monotonic() + 10
    while True:   # request counts ride on heartbeats (one a second): poll, bounded
        r = subprocess.run([sys.executable, "-m", "omni.cli", "status", "--master", master, "--json"],
                           cwd=REPO, env=omni_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        frontends = [x for x in status["replicas"] if x["role"] == "FRONTEND"]
        if all(f["requests_total"] >= 1 for f in frontends) or time.monotonic() > deadline:
            break
    assert len(frontends) == 2
    assert all(f["requests_total"] >= 1 for f in frontends), frontends
    # fe{i} is the frontend with --index i (its metrics label and X-Omni-Frontend), not the i-th to register
    assert sorted((f["replica_id"], int(f["extra"]["frontend_index"])) for f in frontends) == [("fe0", 0), ("fe1", 1)]
    deadline = time.monotonic() + 15
    while True:   # frontends publish their metrics every 2 s: poll, bounded
        m0 = until_frontend(url, "0", "GET", "/metrics").text
        m1 = until_frontend(url, "1", "GET", "/metrics").text
        views = [set(re.findall(r'frontend="([^"]*)"', m)) for m in (m0, m1)]
        if views == [{"0", "1"}] * 2 or time.monotonic() > deadline:
            break
    # One view whichever frontend answers, one label scheme (the index, never "fe0-PID").
    assert views == [{"0", "1"}] * 2, views
    for m in (m0, m1):
        assert m.count("# TYPE omni_frontend_cpu_seconds_total counter") == 1
        assert 'omni_frontend_cpu_seconds_total{frontend="0"}' in m and 'omni_frontend_cpu_seconds_total{frontend="1"}' in m
        assert 'vllm:generation_tokens_total{model_name=' in m


def test_sleep_from_one_frontend_is_seen_by_the_other(server):
    _, url, _ = server
    r = until_frontend(url, "0", "POST", "/v1/omni/sleep", json={"level": 1})   # idempotent
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    # The thinker sleeps; the onnx stages cannot on this platform and say so.
    assert any(x["ok"] for x in results)
    assert any(not x["ok"] and "sleep" in x["message"] for x in results)
    # vllm-omni's fields beside omni's, from the same acks.
    assert r.json()["status"] == "SUCCESS" and [a["status"] == "SUCCESS" for a in r.json()["acks"]] == [
        x["ok"] for x in results]
    s = until_frontend(url, "1", "GET", "/v1/omni/is_sleeping")
    assert s.json() == {"is_sleeping": True}
    r = until_frontend(url, "1", "POST", "/v1/omni/wakeup")
    assert r.status_code == 200, r.text
    s = until_frontend(url, "0", "GET", "/v1/omni/is_sleeping")
    assert s.json() == {"is_sleeping": False}
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    assert fresh(url, "POST", "/v1/chat/completions", json=body).status_code == 200


def _stream(url: str, index: str, max_tokens: int):
    """A streamed chat pinned to frontend `index`, its first chunk read: the request is in flight."""
    c = pinned(url, index)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    ctx = c.stream("POST", "/v1/chat/completions", json=body)
    r = ctx.__enter__()
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["delta"] is not None
    return c, ctx, lines


def test_sleep_from_one_frontend_aborts_a_request_in_flight_on_the_other(server):
    """vLLM's default mode=abort: the stream on frontend 1 ends with an error that says why, at once."""
    _, url, _ = server
    c, ctx, lines = _stream(url, "1", 2000)
    try:
        r = until_frontend(url, "0", "POST", "/v1/omni/sleep")
        assert r.status_code == 200, r.text
        rest = [line for line in lines if line.startswith("data: ")]
    finally:
        ctx.__exit__(None, None, None)
        c.close()
    error = json.loads(rest[-2][6:]) if rest[-1] == "data: [DONE]" else json.loads(rest[-1][6:])
    assert "put to sleep with mode=abort" in error["error"]["message"], rest[-3:]
    assert until_frontend(url, "1", "GET", "/v1/omni/is_sleeping").json() == {"is_sleeping": True}
    assert until_frontend(url, "1", "POST", "/v1/omni/wakeup").status_code == 200
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    assert fresh(url, "POST", "/v1/chat/completions", json=body).status_code == 200


def test_sleep_with_mode_wait_lets_a_request_on_the_other_frontend_finish_first(server):
    """vLLM's mode=wait: new requests get a 503 meanwhile; the one in flight ends whole; then the stages sleep."""
    import threading

    _, url, _ = server
    c, ctx, lines = _stream(url, "1", 400)
    slept: dict = {}

    def sleep() -> None:
        slept["r"] = until_frontend(url, "0", "POST", "/v1/omni/sleep?mode=wait")
        slept["at"] = time.monotonic()

    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    try:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "temperature": 0}
        deadline = time.monotonic() + 60
        while (r := fresh(url, "POST", "/v1/chat/completions", json=body)).status_code == 200:
            assert time.monotonic() < deadline, "no request was refused while the sleep waited"
        assert r.status_code == 503 and "going to sleep" in r.json()["error"]["message"], r.text
        assert "at" not in slept                      # still waiting for the stream
        rest = [line for line in lines if line.startswith("data: ")]
        ended = time.monotonic()
    finally:
        ctx.__exit__(None, None, None)
        c.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length", rest[-2]
    t.join(120)
    assert slept["r"].status_code == 200, slept["r"].text
    assert slept["at"] >= ended - 0.5 and slept["r"].json()["is_sleeping"] is True
    assert until_frontend(url, "1", "POST", "/v1/omni/wakeup").status_code == 200
    assert fresh(url, "POST", "/v1/chat/completions", json=body).status_code == 200


def test_voice_uploaded_through_one_is_listed_by_the_other(server):
    _, url, _ = server
    a, b = pinned(url, "0"), pinned(url, "1")
    try:
        r = a.post("/v1/audio/voices", json={"name": "slowjoe", "base": "joe", "speed": 0.8})
        assert r.status_code in (200, 201), r.text
        names = [v["name"] for v in b.get("/v1/audio/voices").json()["data"]]
        assert "slowjoe" in names and "joe" in names
        speech = b.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "voice": "slowjoe"})
        assert speech.status_code == 200, speech.text
        r = b.delete("/v1/audio/voices/slowjoe")
        assert r.status_code in (200, 204), r.text
        names = [v["name"] for v in a.get("/v1/audio/voices").json()["data"]]
        assert "slowjoe" not in names
        assert a.delete("/v1/audio/voices/joe").status_code == 409   # built in
    finally:
        a.close()
        b.close()


def finished_job(client: httpx.Client, job_id: str, deadline_s: float = 180) -> dict:
    """Poll a job until it is no longer queued or running, within a deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = client.get(f"/v1/omni/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        if job["status"] not in ("queued", "in_progress"):
            return job
        assert time.monotonic() < deadline, f"job still {job['status']} after {deadline_s} s: {job}"
        time.sleep(0.2)   # poll pacing; the deadline bounds the wait


def test_speech_job_made_on_one_frontend_is_served_by_the_other(server):
    _, url, _ = server
    body = {"model": MODEL, "input": "Jobs run in the background.", "voice": "joe"}
    a, b = pinned(url, "0"), pinned(url, "1")
    try:
        r = a.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": body})
        assert r.status_code == 200 and r.headers["x-omni-frontend"] == "0", r.text
        job = r.json()
        assert job["frontend"] == 0 and job["status"] in ("queued", "in_progress")
        done = finished_job(b, job["id"])
        assert done["status"] == "completed", done
        wav = b.get(f"/v1/omni/jobs/{job['id']}/content")
        assert wav.status_code == 200 and wav.headers["x-omni-frontend"] == "1"
        assert wav.headers["content-type"] == "audio/wav" and len(wav.content) == done["bytes"]
        with wave.open(io.BytesIO(wav.content)) as w:
            assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getnframes() > w.getframerate() // 2
        sync = b.post("/v1/audio/speech", json=body)
        assert sync.status_code == 200 and wav.content == sync.content   # the pipeline is deterministic
        assert job["id"] in [j["id"] for j in a.get("/v1/omni/jobs").json()["data"]]
        d = b.delete(f"/v1/omni/jobs/{job['id']}")
        assert d.json() == {"id": job["id"], "object": "omni.job.deleted", "deleted": True}
        for c in (a, b):
            r = c.get(f"/v1/omni/jobs/{job['id']}")
            assert r.status_code == 404 and r.json()["error"]["param"] == "job_id"
    finally:
        a.close()
        b.close()


def test_chat_job_content_is_the_sync_chat_response(server):
    _, url, _ = server
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    a, b = pinned(url, "0"), pinned(url, "1")
    try:
        r = b.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": body})
        assert r.status_code == 200, r.text
        assert r.json()["frontend"] == 1
        done = finished_job(a, r.json()["id"])
        assert done["status"] == "completed" and done["content_type"] == "application/json", done
        got = a.get(f"/v1/omni/jobs/{done['id']}/content").json()
        sync = a.post("/v1/chat/completions", json=body).json()
        assert set(got) == set(sync) and got["object"] == "chat.completion"
        assert got["choices"][0]["message"] == sync["choices"][0]["message"]
        assert "Paris" in got["choices"][0]["message"]["content"]
        stream = a.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": {**body, "stream": True}})
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "body.stream"
        assert a.delete(f"/v1/omni/jobs/{done['id']}").status_code == 200
    finally:
        a.close()
        b.close()


def test_sigkill_of_one_frontend_leaves_the_other_serving_and_it_comes_back(server):
    p, url, _ = server
    victims = [c for c in psutil.Process(p.proc.pid).children(recursive=True)
               if "frontend" in c.cmdline() and "1" == c.cmdline()[c.cmdline().index("--index") + 1]]
    assert len(victims) == 1
    victims[0].send_signal(signal.SIGKILL)
    victims[0].wait(10)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    ok = [fresh(url, "POST", "/v1/chat/completions", json=body) for _ in range(4)]
    assert all(r.status_code == 200 for r in ok)
    # The parent restarts it; it binds the same port again and serves.
    p.wait_for(__import__("re").compile(r"api1 was killed by SIGKILL; restarting it in "), 30)
    until_frontend(url, "1", "GET", "/health", tries=400)
    assert p.proc.poll() is None


def test_job_of_a_killed_frontend_reads_as_failed_from_the_other(server):
    p, url, _ = server
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    a, b = pinned(url, "0"), pinned(url, "1")
    try:
        job = a.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions", "body": body}).json()
        assert b.get(f"/v1/omni/jobs/{job['id']}").json()["status"] in ("queued", "in_progress")
        victims = [c for c in psutil.Process(p.proc.pid).children(recursive=True)
                   if "frontend" in c.cmdline() and c.cmdline()[c.cmdline().index("--index") + 1] == "0"]
        assert len(victims) == 1
        victims[0].send_signal(signal.SIGKILL)
        victims[0].wait(10)
        # Failed once the master drops the frontend's lease (lease_ttl_s), never stuck in progress.
        done = finished_job(b, job["id"], deadline_s=60)
        assert done["status"] == "failed" and done["error"]["code"] == "frontend_gone", done
        assert "frontend 0" in done["error"]["message"]
        assert b.delete(f"/v1/omni/jobs/{job['id']}").status_code == 200
    finally:
        a.close()
        b.close()
    # The parent restarts it; new connections reach it once it listens again.
    p.wait_for(__import__("re").compile(r"api0 was killed by SIGKILL; restarting it in "), 30)
    deadline = time.monotonic() + 120
    while True:
        try:
            until_frontend(url, "0", "GET", "/health", tries=100)
            break
        except (AssertionError, httpx.HTTPError):
            assert time.monotonic() < deadline, "frontend 0 did not come back within 120 s"
