"""Issue 8, item 5: the head and headless stages on two hosts.

The hosts are two fresh network namespaces joined by a veth pair (tests/e2e/netns.py). Host A runs the
head (master, thinker, HTTP frontend); host B runs the talker and code2wav headless.
Stages advertise their own address (auto-detected, or --omni-replica-address); tensors go
over TCP between the hosts and over shared memory within B.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
import wave
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from tests.e2e.harness import SERVING, OmniProcess, omni_env, omni_shm_entries
from tests.e2e.netns import METRIC, TOKEN, Host, hosts, kill_all, status  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Deployment:
    a: Host
    b: Host
    master: str
    url: str
    procs: list[OmniProcess]
    shm_before: set[str]


@pytest.fixture(scope="module")
def deployment(hosts):
    a, b = hosts
    procs: list[OmniProcess] = []
    shm_before = set(omni_shm_entries())
    try:
        # HTTP on every address of A (there are only lo and the veth end): the frontend must
        # still advertise A's address, not 0.0.0.0.
        head = OmniProcess("serve", MODEL, "--stage-id", "0", "--omni-master-address", a.addr,
                           "--omni-master-port", "0", "--host", "0.0.0.0", "--port", "0", prefix=a.prefix,
                           env=omni_env(OMNI_TOKEN=TOKEN))
        procs.append(head)
        master = head.master_address(120)
        assert master.startswith(f"{a.addr}:"), master
        port = master.rsplit(":", 1)[1]
        # The talker auto-detects its address (the route to the master); code2wav names it.
        procs.append(OmniProcess("serve", MODEL, "--stage-id", "1", "--headless",
                                 "--omni-master-address", a.addr, "--omni-master-port", port, prefix=b.prefix,
                                 env=omni_env(OMNI_TOKEN=TOKEN)))
        procs.append(OmniProcess("serve", MODEL, "--stage-id", "2", "--headless",
                                 "--omni-master-address", a.addr, "--omni-master-port", port,
                                 "--omni-replica-address", b.addr, prefix=b.prefix,
                                 env=omni_env(OMNI_TOKEN=TOKEN)))
        m = head.wait_for(SERVING, 600)
        assert m.group(1) == "0.0.0.0", m.group(0)
        yield Deployment(a, b, master, f"http://{a.addr}:{m.group(2)}", procs, shm_before)
    finally:
        kill_all(procs)


def test_status_shows_each_replica_on_its_own_host(deployment):
    a, b, master = deployment.a, deployment.b, deployment.master
    r = status(a, master, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    stages = {rep["stage_id"]: rep for rep in doc["replicas"] if rep["role"] == "STAGE"}
    assert sorted(stages) == [0, 1, 2]
    assert stages[0]["host"] == a.addr
    assert stages[1]["host"] == b.addr     # auto-detected
    assert stages[2]["host"] == b.addr     # --omni-replica-address
    for sid, host in ((0, a.addr), (1, b.addr), (2, b.addr)):
        assert stages[sid]["endpoints"]["channel"].startswith(f"tcp://{host}:"), stages[sid]["endpoints"]
    fronts = [rep for rep in doc["replicas"] if rep["role"] == "FRONTEND"]
    assert [f["host"] for f in fronts] == [a.addr]   # bound on 0.0.0.0, advertises A

    table = status(a, master)
    assert table.returncode == 0, table.stdout + table.stderr
    rows = {}
    lines = table.stdout.splitlines()
    header = next(line for line in lines if line.startswith("STAGE"))
    assert header.split()[:3] == ["STAGE", "REPLICA", "HOST"]
    for line in lines[lines.index(header) + 1:]:
        if not line.strip():
            break
        cols = line.split()
        rows[int(cols[0])] = cols[2]
    assert rows == {0: a.addr, 1: b.addr, 2: b.addr}


def _wav(data: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def assert_speech(data: bytes, min_s: float, max_s: float) -> None:
    rate, pcm = _wav(data)
    assert rate == 22050
    assert min_s < len(pcm) / rate < max_s, len(pcm) / rate
    assert np.abs(pcm.astype(np.int32)).max() > 1000, "silent audio"


def test_speech_across_hosts_is_valid_and_deterministic(deployment):
    a, url = deployment.a, deployment.url
    body = {"model": MODEL, "input": "Hello there, this is omni speaking.", "voice": "joe",
            "response_format": "wav"}
    first = a.call(httpx.post, f"{url}/v1/audio/speech", json=body, timeout=120)
    assert first.status_code == 200, first.text
    assert_speech(first.content, 0.8, 10.0)
    again = a.call(httpx.post, f"{url}/v1/audio/speech", json=body, timeout=120)
    assert again.status_code == 200, again.text
    assert again.content == first.content


def test_chat_with_audio_across_hosts(deployment):
    a, url = deployment.a, deployment.url
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0, "modalities": ["text", "audio"],
            "audio": {"voice": "joe", "format": "wav"}}
    r = a.call(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]     # OpenAI's shape (the request has an audio object): one choice
    assert choice["message"]["content"] is None and "Paris" in choice["message"]["audio"]["transcript"]
    assert_speech(base64.b64decode(choice["message"]["audio"]["data"]), 0.5, 30.0)


def test_tensors_cross_hosts_over_tcp_and_stay_in_shared_memory_within_one(deployment):
    """code2wav (B) -> frontend (A) over TCP; talker -> code2wav (both on B) over shared memory.
    The frontend counts the bytes of every tensor it routes or receives, by transport; each
    stage counts what it publishes and reads (`omni status --json`, replica extra)."""
    a, url = deployment.a, deployment.url
    body = {"model": MODEL, "input": "Counting bytes.", "voice": "joe", "response_format": "wav"}
    r = a.call(httpx.post, f"{url}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text
    metrics = a.call(httpx.get, f"{url}/metrics", timeout=30)
    assert metrics.status_code == 200
    by_transport = {t: int(n) for t, n in METRIC.findall(metrics.text)}
    assert by_transport.get("tcp", 0) > 0, by_transport
    assert by_transport.get("shm", 0) > 0, by_transport
    assert set(by_transport) <= {"tcp", "shm"}, by_transport
    # Stage channels: the thinker shares the frontend's network namespace (local); the other two
    # have the same host name but another namespace, so the local connect fails and ZMQ serves them.
    # A channel opens on first use: speech never reaches the thinker, so one chat does (this test
    # must not depend on another having run first).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = a.call(httpx.post, f"{url}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    metrics = a.call(httpx.get, f"{url}/metrics", timeout=30)
    channels = {k: float(n) for k, n in re.findall(r'omni_stage_channels\{[^}]*kind="(\w+)"\} (\S+)', metrics.text)}
    assert channels == {"local": 1, "zmq": 2}, channels

    # The stages count the same, by direction and transport, in their load reports.
    def counters() -> dict[int, dict[str, float]]:
        r = status(a, deployment.master, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        return {rep["stage_id"]: {k: v for k, v in rep["extra"].items() if k.startswith("tensor_bytes_")}
                for rep in json.loads(r.stdout)["replicas"] if rep["role"] == "STAGE"}

    deadline = time.monotonic() + 30
    seen = counters()
    while seen[2].get("tensor_bytes_out.tcp", 0) == 0 and time.monotonic() < deadline:
        seen = counters()   # the next keep-alive carries it (each call takes a process start)
    talker, code2wav = seen[1], seen[2]
    assert talker.get("tensor_bytes_out.shm", 0) > 0 and "tensor_bytes_out.tcp" not in talker, seen
    assert code2wav.get("tensor_bytes_in.shm", 0) > 0 and "tensor_bytes_in.tcp" not in code2wav, seen
    assert code2wav.get("tensor_bytes_out.tcp", 0) > 0 and "tensor_bytes_out.shm" not in code2wav, seen


def test_ctrl_c_stops_every_host(deployment):
    """Last: the head and the headless stages each stop cleanly on Ctrl-C, leaving no shared memory."""
    for p in deployment.procs:
        assert p.interrupt(60) == 0, p.output()
    assert set(omni_shm_entries()) <= deployment.shm_before
