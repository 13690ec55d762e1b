"""Issue 5, items 3-5, beyond one `omni serve` command: a head with two frontends and headless
stages, its voices persisted with --state-dir and restored when the head starts again (the
headless stages keep their engines and re-register), and a stage that dies with no replica
left stops the deployment with a message that names it."""

from __future__ import annotations

import re
import signal

import psutil
import pytest

from tests.e2e.harness import OmniProcess, descendants, omni_shm_entries
from tests.e2e.test_api_servers import fresh, until_frontend

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def head(port: str, state_dir: str) -> OmniProcess:
    return OmniProcess("serve", MODEL, "--stage-id", "0", "--api-server-count", "2", "--omni-master-address",
                       "127.0.0.1", "--omni-master-port", port, "--port", "0", "--state-dir", state_dir)


def stop(procs) -> None:
    for p in procs:
        p.stop(60)   # Ctrl-C, then the whole tree gone (SIGKILL past the deadline)


def speech(url: str, index: str, voice: str) -> bytes:
    r = until_frontend(url, index, "POST", "/v1/audio/speech",
                       json={"model": MODEL, "input": "Saved voices come back.", "voice": voice})
    assert r.status_code == 200, r.text
    assert r.content[:4] == b"RIFF"
    return r.content


def test_head_with_two_frontends_and_headless_stages_restores_voices_after_restart(tmp_path):
    state = str(tmp_path / "state")
    first = head("0", state)
    procs = [first]
    try:
        port = first.master_address().rsplit(":", 1)[1]
        stages = [OmniProcess("serve", MODEL, "--stage-id", k, "--headless", "--omni-master-address", "127.0.0.1",
                              "--omni-master-port", port) for k in ("1", "2")]
        procs += stages
        url = first.http(300)
        assert {fresh(url, "GET", "/v1/models").headers["x-omni-frontend"] for _ in range(60)} == {"0", "1"}
        r = until_frontend(url, "0", "POST", "/v1/audio/voices", json={"name": "slow-joe", "base": "joe", "speed": 0.8})
        assert r.status_code == 201, r.text
        before = speech(url, "1", "slow-joe")
        stage_pids = [p.proc.pid for p in stages]

        # The head goes away and comes back on the same master port; the stages wait, keep their
        # engines and register again; the voice was persisted under --state-dir.
        assert first.interrupt(60) == 0, first.output()
        # Issue 16: open keep-alive and watch streams end without a traceback when the head stops.
        said = "\n".join(first.lines)
        assert "Traceback" not in said and "Task was destroyed" not in said, first.output()
        second = head(port, state)
        procs.append(second)
        url = second.http(300)
        for p in stages:
            p.wait_for(re.compile(r"re-registered as replica"), 60)
            assert p.proc.poll() is None
        assert [p.proc.pid for p in stages] == stage_pids
        assert all(sum("engine loaded" in line for line in p.lines) == 1 for p in stages)
        names = {v["name"] for v in until_frontend(url, "1", "GET", "/v1/audio/voices").json()["data"]}
        assert {"joe", "slow-joe"} <= names
        assert speech(url, "0", "slow-joe") == before     # deterministic pipeline, same voice settings
    finally:
        stop(procs)


def test_a_stage_dying_with_no_replica_left_stops_the_deployment_by_name():
    p = OmniProcess("serve", MODEL, "--port", "0")
    try:
        url = p.http(300)
        assert fresh(url, "GET", "/health").status_code == 200
        children = descendants(p.proc.pid)
        code2wav = next(c for c in children if "--stage-id" in psutil.Process(c).cmdline()
                        and psutil.Process(c).cmdline()[psutil.Process(c).cmdline().index("--stage-id") + 1] == "2")
        psutil.Process(code2wav).send_signal(signal.SIGKILL)
        assert p.proc.wait(60) == 1
        line = p.wait_for(re.compile(r"no replica of stage 2 is left"), 5).string
        assert "code2wav" in line and "shutting down" in line, p.output()
        assert not [c for c in children if psutil.pid_exists(c) and psutil.Process(c).status() != "zombie"]
        assert omni_shm_entries() == []
    finally:
        if p.proc.poll() is None:
            p.kill()
