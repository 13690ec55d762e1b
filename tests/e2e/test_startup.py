"""Issue 8, item 4: start-up in any order. Headless stages may start before the head and
wait for its master; the head's deadline message names the stages still missing; a
stage whose pipeline config differs from the head's is refused with the difference."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.harness import REPO, OmniProcess, unused_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT = REPO / "deploy" / "smollm2-135m-instruct.yaml"


def deploy_file(tmp_path: Path, name: str, **pipeline) -> str:
    raw = yaml.safe_load(DEFAULT.read_text())
    raw["pipeline"].update(pipeline)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def headless(stage: int, port: int, config: str) -> OmniProcess:
    return OmniProcess("serve", MODEL, "--stage-id", str(stage), "--headless", "--deploy-config", config,
                       "--omni-master-address", "127.0.0.1", "--omni-master-port", str(port))


def stop_all(procs) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.kill()


def test_stages_before_the_head_then_a_stage_after_it_and_a_mismatched_one_is_refused(tmp_path):
    config = deploy_file(tmp_path, "pipeline.yaml")
    port = unused_port()
    procs = []
    try:
        # code2wav first, with no master anywhere yet: it loads and waits.
        code2wav = headless(2, port, config)
        procs.append(code2wav)
        code2wav.wait_for(re.compile(r"stage 2 \(code2wav\): engine loaded"), 120)
        assert code2wav.proc.poll() is None
        head = OmniProcess("serve", MODEL, "--stage-id", "0", "--deploy-config", config,
                           "--omni-master-address", "127.0.0.1", "--omni-master-port", str(port), "--port", "0")
        procs.append(head)
        assert head.master_address().endswith(f":{port}")
        # code2wav finds the master on its own; the head names the one stage still missing.
        code2wav.wait_for(re.compile(r"registered as replica"), 120)
        head.wait_for(re.compile(r"waiting for stage 1 \(talker\)$"), 120)
        talker = headless(1, port, config)
        procs.append(talker)
        url = head.http(300)
        r = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={"model": MODEL, "input": "In any order."})
        assert r.status_code == 200, r.text
        assert r.content[:4] == b"RIFF" and len(r.content) > 10_000

        # A talker started with another pipeline config is refused, naming the difference.
        other = deploy_file(tmp_path, "other.yaml", request_timeout_s=123)
        odd = headless(1, port, other)
        procs.append(odd)
        assert odd.proc.wait(120) != 0
        words = odd.output()
        # refused before its engine loads (331aa2e: it asks the master first)
        assert "config differs" in words and "request_timeout_s" in words, words
        assert "the engine is not loaded" in words and "engine loaded" not in words.replace("not loaded", ""), words
        assert "123" in words and "300" in words, words
        # ... and the deployment did not notice.
        r = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={"model": MODEL, "input": "Still here."})
        assert r.status_code == 200, r.text
    finally:
        stop_all(procs)


def test_head_deadline_names_the_missing_stages(tmp_path):
    config = deploy_file(tmp_path, "short.yaml", startup_timeout_s=45)
    head = OmniProcess("serve", MODEL, "--stage-id", "0", "--deploy-config", config,
                       "--omni-master-address", "127.0.0.1", "--omni-master-port", "0", "--port", "0")
    try:
        assert head.proc.wait(150) == 1
        line = head.wait_for(re.compile(r"start-up deadline passed; still waiting for (.*)"), 5).group(1)
        assert "stage 1 (talker)" in line and "stage 2 (code2wav)" in line, head.output()
        assert "stage 0" not in line, head.output()
    finally:
        stop_all([head])
