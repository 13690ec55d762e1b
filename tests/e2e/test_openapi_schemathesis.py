"""Issue 15, item 5: Schemathesis over every route of the served openapi.json finds no 5xx, no
schema-valid request refused, no undocumented status or content type, and a 405 with `Allow`
for every method a path lacks. A real `omni serve` of the default pipeline (SmolLM2 -> Piper).

Bounded: the deployment states small limits (max_tokens 1, speech input 16 characters), which
openapi.json carries as maximum / maxLength, so generated requests are cheap to serve;
deterministic generation, so a run is the same every time."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.e2e.harness import OmniProcess, omni_shm_entries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHECKS = ("not_a_server_error,status_code_conformance,positive_data_acceptance,response_schema_conformance,"
          "content_type_conformance,unsupported_method,allow_header_conformance")
# POST /v1/omni/sleep puts the thinker to sleep, and a generation route then answers 503 (as
# documented): the control routes get a run of their own, after the others.
CONTROL = "^(/v1/omni/(sleep|wakeup|is_sleeping)|/sleep|/wake_up|/is_sleeping)$"
JOBS = "/v1/omni/jobs"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    config.write_text("base_config: smollm2-135m-instruct.yaml\n"
                      "pipeline: {max_tokens_limit: 1, max_speech_chars: 16}\n")
    p = OmniProcess("serve", MODEL, "--deploy-config", str(config), "--port", "0")
    try:
        yield p.http(300)
    finally:
        # Ctrl-C: the server stops its stage processes; the whole tree gone, its shm with it
        assert omni_shm_entries(p.stop(60)) == []


def schemathesis(url: str, cwd, *args: str, max_examples: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", CHECKS,
           "--max-examples", str(max_examples), "--generation-deterministic",
           "--workers", "1", "--request-timeout", "60", "--no-color", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=420)


def assert_clean(run: subprocess.CompletedProcess) -> None:
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-12000:]
    assert "Schema Error" not in out, out[-4000:]


@pytest.mark.timeout(900)   # a shared 2-core box under load; about 2 minutes on a quiet one
def test_schemathesis_finds_nothing_on_the_data_routes(server, tmp_path):
    # Every phase, boundary values (coverage) included, on every route but job creation: its
    # coverage cases are the three generation routes' again, each one more background job.
    assert_clean(schemathesis(server, tmp_path, "--exclude-path-regex", f"{CONTROL}|^{JOBS}$",
                              max_examples=5))
    # --include-name: --include-path with --include-method selected every POST (either matched), sleep too,
    # which then aborted the jobs in flight (vLLM's mode=abort) and slept the thinker under the other routes.
    assert_clean(schemathesis(server, tmp_path, "--include-name", f"POST {JOBS}",
                              "--phases", "fuzzing,stateful", max_examples=5))
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_schemathesis_finds_nothing_on_the_control_routes(server, tmp_path):
    try:
        assert_clean(schemathesis(server, tmp_path, "--include-path-regex", CONTROL, max_examples=8))
    finally:
        httpx.post(f"{server}/v1/omni/wakeup", timeout=60)
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                      timeout=60).status_code == 200


def test_the_spec_states_the_deployment_limits(server):
    spec = httpx.get(f"{server}/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert {"type": "integer", "minimum": 1, "maximum": 1} in chat["max_tokens"]["anyOf"]
    assert schemas["SpeechRequest"]["properties"]["input"]["maxLength"] == 16
    sleep = spec["paths"]["/v1/omni/sleep"]["post"]
    assert sleep["requestBody"]["required"] is False and {"401", "403"} <= set(sleep["responses"])
    job = spec["paths"]["/v1/omni/jobs/{job_id}"]["get"]
    assert job["parameters"][0]["name"] == "job_id" and "404" in job["responses"]
    r = httpx.request("PUT", f"{server}/v1/audio/voices", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.text
    assert r.json()["error"]["message"]
