"""`omni serve` on IPv6 alone: the master, the HTTP frontend and every stage's data plane on ::1.

The stages advertise ::1 (the route to an IPv6 master; they had refused one at another host's IPv6 address
and could not bind an IPv6 --omni-replica-address). OMNI_STAGE_CHANNEL=zmq sends the frontend's requests over
ZMQ to tcp://[::1]:PORT, not the same-host local channel, and the talker -> code2wav connector is tcp, so the
latents cross stages over a tcp tensor connection on ::1."""

from __future__ import annotations

import io
import re
import wave

import httpx
import psutil
import pytest

from tests.e2e.harness import REPO, OmniProcess, omni_env, omni_shm_entries, wait_gone
from tests.e2e.netns import METRIC
from tests.unit.test_master_ipv6 import needs_ipv6

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVING_V6 = re.compile(r"serving .* on http://\[::1\]:(\d+) ")
STAGE_ON_V6 = re.compile(r"registered as replica \S+, serving on tcp://\[::1\]:\d+")


def _deploy_with_tcp_tensors(tmp_path) -> str:
    text = (REPO / "omni" / "deploy" / "smollm2-135m-instruct.yaml").read_text()
    changed = text.replace('"2": {transport: auto}', '"2": {transport: tcp}')
    assert changed != text, "the bundled deploy's talker connector moved: update this test"
    path = tmp_path / "smollm2-tcp.yaml"
    path.write_text(changed)
    return str(path)


@needs_ipv6
def test_a_pipeline_serves_chat_and_speech_over_ipv6(tmp_path):
    p = OmniProcess("serve", MODEL, "--deploy-config", _deploy_with_tcp_tensors(tmp_path),
                    "--omni-master-address", "::1", "--host", "::1", "--port", "0",
                    env=omni_env(OMNI_STAGE_CHANNEL="zmq"))
    try:
        url = f"http://[::1]:{p.wait_for(SERVING_V6, 300).group(1)}"
        assert len([x for x in p.lines if STAGE_ON_V6.search(x)]) == 3, p.output()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        r = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={"model": MODEL, "input": "Hi there."})
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() > 0
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        by_transport = {t: int(n) for t, n in METRIC.findall(metrics)}
        assert by_transport.get("tcp", 0) > 0, by_transport          # the latents, talker -> code2wav
        channels = {k: float(v) for k, v in re.findall(r'^omni_stage_channels\{[^}]*kind="(\w+)"\} (\S+)$',
                                                         metrics, re.M)}
        assert channels == {"local": 0.0, "zmq": 3.0}, channels
        children = psutil.Process(p.proc.pid).children(recursive=True)
        assert p.interrupt(60) == 0, p.output()
        assert not wait_gone(children, 30)
        assert omni_shm_entries([p.proc.pid, *(c.pid for c in children)]) == []
    finally:
        p.stop(60)
