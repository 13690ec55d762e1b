"""A real `omni serve` whose master runs with mTLS (--tls-cert/--tls-key/--tls-ca): its stages and
frontends connect with the files and a chat is served; `omni status` with the CA and a client
certificate reads it, a plaintext one or one without a client certificate is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.certs import make_certs
from tests.e2e.harness import REPO, OmniProcess, omni_env, omni_shm_entries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _status(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni.cli", "status", "--json", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_serve_with_mtls_master_serves_and_refuses_plaintext(tmp_path):
    pytest.importorskip("cryptography")
    certs = make_certs(tmp_path)
    env = omni_env(OMNI_RUN_DIR=str(tmp_path), OMNI_TOKEN="tls-test-token")
    p = OmniProcess("serve", MODEL, "--port", "0", "--tls-cert", certs["server"], "--tls-key", certs["server_key"],
                    "--tls-ca", certs["ca"], env=env)
    pids: list[int] = []
    try:
        url = p.http(300)
        assert any("master listening on 127.0.0.1:" in line and "(TLS)" in line for line in p.lines), p.output()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]

        st = _status(env, "--tls-ca", certs["ca"], "--tls-cert", certs["client"], "--tls-key", certs["client_key"])
        assert st.returncode == 0, st.stderr
        roles = {rep["role"] for rep in json.loads(st.stdout)["replicas"]}
        assert roles == {"STAGE", "FRONTEND"}

        # A bare `omni status` on this host connects as serve's own processes do (the run file's TLS paths).
        bare = _status(env)
        assert bare.returncode == 0 and "(TLS)" in bare.stderr, bare.stderr
        address = next(line for line in p.lines if "master listening on" in line).split()[-2]
        plain = _status(env, "--master", address)
        assert plain.returncode == 2, plain.stdout
        assert "a master with TLS closes plaintext connections" in plain.stderr, plain.stderr
        no_cert = _status(env, "--tls-ca", certs["ca"])
        assert no_cert.returncode == 2 and "requires client certificates" in no_cert.stderr, no_cert.stderr
    finally:
        pids = p.stop(60)
    assert omni_shm_entries(pids) == []
