"""Issue 4: `omni serve` end to end with real processes, real Hypercorn, the real model."""

from __future__ import annotations

import base64
import io
import json
import wave

import httpx
import psutil
import pytest

from tests.e2e.harness import OmniProcess, omni_env, omni_shm_entries, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference_text():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni.models.resolve import resolve_model

    torch.set_num_threads(1)
    path = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
    return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def server():
    p = OmniProcess("serve", MODEL, "--port", "0")
    try:
        url = p.http(300)
        yield p, url
    finally:
        # Ctrl-C and wait for the whole tree (a SIGKILLed launcher's children outlive it for a
        # moment, orphaned); nothing of it may be left, in the process table or in /dev/shm.
        pids = p.stop(60)
        assert omni_shm_entries(pids) == []


def chat(url, **body):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_chat_non_streaming_equals_in_process_greedy(server, reference_text):
    _, url = server
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert text == reference_text
    assert "Paris" in text
    assert body["usage"]["completion_tokens"] > 0
    assert r.headers["x-omni-frontend"] == "0"


def test_chat_streaming_joins_to_the_same_text(server, reference_text):
    _, url = server
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                deltas.append(choice["delta"].get("content") or "")
    assert "".join(deltas) == reference_text


def test_health_models_and_metrics(server):
    _, url = server
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert MODEL in [m["id"] for m in models["data"]]
    metrics = httpx.get(f"{url}/metrics").text
    assert "omni_pipeline_requests_total" in metrics


def pipeline_outcomes(url: str) -> dict[str, float]:
    lines = [x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith("omni_pipeline_requests_total{")]
    return {o: sum(float(x.rsplit(" ", 1)[1]) for x in lines if f'outcome="{o}"' in x) for o in ("ok", "aborted", "failed")}


def test_a_completed_request_counts_as_ok(server):
    """Issue 16: every HTTP 200 was counted as a failed pipeline request (and aborted in every stage)."""
    _, url = server
    before = pipeline_outcomes(url)
    assert chat(url, max_tokens=4).status_code == 200
    assert pipeline_outcomes(url) == {**before, "ok": before["ok"] + 1}


def stage_channels(url: str) -> dict[str, float]:
    """The frontend's open stage channels by carrier (omni_stage_channels)."""
    lines = [x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith("omni_stage_channels{")]
    return {k: sum(float(x.rsplit(" ", 1)[1]) for x in lines if f'kind="{k}"' in x) for k in ("local", "zmq")}


def test_stages_on_this_host_are_reached_over_the_local_channel(server):
    _, url = server
    r = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={"model": MODEL, "input": "Hi."})
    assert r.status_code == 200, r.text          # every stage has seen a request
    assert stage_channels(url) == {"local": 3, "zmq": 0}


@pytest.mark.parametrize("body, status", [
    ({"model": "nope", "messages": QUESTION}, 404),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400),
    ({"model": MODEL, "messages": QUESTION, "modalities": ["video"]}, 400),
    ({"model": MODEL, "messages": "hello"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 5000}]}, 400),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, body, status):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_malformed_json_is_a_400(server):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


def _wav(data: bytes):
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes()


def test_speech_returns_a_plausible_wav(server):
    _, url = server
    text = "Hello there, this is omni speaking."
    r = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                   json={"model": MODEL, "input": text, "voice": "joe", "response_format": "wav"})
    assert r.status_code == 200, r.text
    rate, frames = _wav(r.content)
    assert rate == 22050
    assert 0.3 * 6 < frames / rate < 1.5 * 6
    again = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                       json={"model": MODEL, "input": text, "voice": "joe", "response_format": "wav"})
    assert again.content == r.content   # deterministic voice (noise scales 0 by default)


def test_chat_with_audio_returns_text_and_audio(server, reference_text):
    _, url = server
    r = chat(url, modalities=["text", "audio"], audio={"voice": "joe", "format": "wav"})
    assert r.status_code == 200, r.text
    (audio,) = (c["message"] for c in r.json()["choices"])     # OpenAI's shape: one choice, the text its transcript
    assert audio["content"] is None and audio["audio"]["transcript"] == reference_text
    rate, frames = _wav(base64.b64decode(audio["audio"]["data"]))
    assert rate == 22050 and frames / rate > 0.5


def test_ctrl_c_leaves_nothing_behind(server):
    p, _ = server
    children = psutil.Process(p.proc.pid).children(recursive=True)
    assert len(children) >= 4   # 3 stages + 1 frontend
    assert p.interrupt(60) == 0, p.output()
    alive = wait_gone(children, 30)   # a zombie counts as gone (CI's init may never reap one)
    assert not alive, alive
    assert omni_shm_entries([p.proc.pid, *(c.pid for c in children)]) == []


def test_stage_based_launch_head_plus_two_headless():
    head = OmniProcess("serve", MODEL, "--stage-id", "0", "--omni-master-address", "127.0.0.1",
                       "--omni-master-port", "0", "--port", "0")
    others = []
    try:
        master = head.master_address()
        port = master.rsplit(":", 1)[1]
        for k in ("1", "2"):
            # OMNI_STAGE_CHANNEL=zmq on these two: they publish no local endpoint, so this
            # deployment runs both carriers at once.
            others.append(OmniProcess("serve", MODEL, "--stage-id", k, "--headless",
                                      "--omni-master-address", "127.0.0.1", "--omni-master-port", port,
                                      env=omni_env(OMNI_STAGE_CHANNEL="zmq")))
        url = head.http(300)
        r = chat(url, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        r = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={"model": MODEL, "input": "Hi there."})
        assert r.status_code == 200, r.text
        assert stage_channels(url) == {"local": 1, "zmq": 2}
        assert head.interrupt(60) == 0
        for o in others:
            # Headless stages outlive a head restart by design; Ctrl-C them too.
            assert o.interrupt(60) == 0, o.output()
    finally:
        for p in [head, *others]:
            p.stop(60)
