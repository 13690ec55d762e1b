"""A headless stage-0 replica started with a smaller --max-model-len beside the head (issue 15,
item 2): long prompts go only to the replica that can take them, none fails."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.harness import READY, REPO, OmniProcess, omni_env, omni_shm_entries

pytestmark = [pytest.mark.e2e]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEPLOY = """
model: local
pipeline: {name: lm}
stages:
  - stage_id: 0
    engine: torch_lm
    engine_args: {dtype: float32, max_num_seqs: 4, max_model_len: 2048}
    default_sampling_params: {temperature: 0.0, max_tokens: 4}
    inputs: [prompt]
    final_output: true
    final_output_type: text
"""


def test_long_prompts_avoid_the_replica_with_the_smaller_max_model_len(tmp_path):
    from omni.models.resolve import resolve_model

    path = resolve_model(MODEL)
    config = tmp_path / "lm.yaml"
    config.write_text(DEPLOY)
    head = OmniProcess("serve", path, "--deploy-config", str(config), "--stage-id", "0", "--omni-master-address",
                       "127.0.0.1", "--omni-master-port", "0", "--port", "0", "--served-model-name", "lm")
    procs = [head]
    try:
        port = head.master_address().rsplit(":", 1)[1]
        small = OmniProcess("serve", path, "--deploy-config", str(config), "--stage-id", "0", "--headless",
                            "--omni-master-address", "127.0.0.1", "--omni-master-port", port,
                            "--max-model-len", "1024")
        procs.append(small)
        url = head.http(300)
        small.wait_for(READY, 300)
        long_prompt = [{"role": "user", "content": "hello " * 1400}]

        def chat(_):
            return httpx.post(f"{url}/v1/chat/completions", timeout=300,
                              json={"model": "lm", "messages": long_prompt, "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(chat, range(4)))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert all(r.json()["usage"]["prompt_tokens"] > 1024 for r in answers)
        short = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                           json={"model": "lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert short.status_code == 200, short.text
    finally:
        pids = [pid for p in procs for pid in p.stop(60)]   # Ctrl-C: each launcher stops its own children
        assert omni_shm_entries(pids) == []


def test_num_replicas_in_single_command_mode(tmp_path):
    """`--num-replicas` without --stage-id: every stage gets N (vllm-omni's --omni-dp-size-local refuses it)."""
    from omni.models.resolve import resolve_model

    config = tmp_path / "lm.yaml"
    config.write_text(DEPLOY)
    p = OmniProcess("serve", resolve_model(MODEL), "--deploy-config", str(config), "--port", "0",
                    "--num-replicas", "2")
    try:
        master = p.master_address(120)
        p.http(300)
        deadline = time.monotonic() + 180
        while True:   # the second replica may still be loading when the first makes the pipeline ready
            r = subprocess.run([sys.executable, "-m", "omni.cli", "status", "--master", master, "--json"],
                               cwd=REPO, env=omni_env(), capture_output=True, text=True, timeout=60)
            stages = [x for x in json.loads(r.stdout)["replicas"] if x["role"] == "STAGE"]
            if [x["state"] for x in stages] == ["READY"] * 2 or time.monotonic() > deadline:
                break
            threading.Event().wait(1.0)   # polling a remote condition, bounded by the deadline
        assert [x["state"] for x in stages] == ["READY"] * 2, stages
    finally:
        assert omni_shm_entries(p.stop(60)) == []
