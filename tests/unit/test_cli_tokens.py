"""An empty --omni-token / OMNI_TOKEN is refused by name in every command that takes it: empty, the master
would run without auth (and the clients send none), which a mistyped secret should never cause."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO


def omni(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OMNI_TOKEN"}
    return subprocess.run([sys.executable, "-m", "omni.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**base, **(env or {})})


@pytest.mark.parametrize("args, env, message", [
    (["master", "--port", "0", "--omni-token", ""], None, "--omni-token is empty"),
    (["master", "--port", "0"], {"OMNI_TOKEN": ""}, "OMNI_TOKEN (the environment's --omni-token) is empty"),
    (["status", "--master", "127.0.0.1:1", "--omni-token="], None, "--omni-token is empty"),
    (["status", "--master", "127.0.0.1:1"], {"OMNI_TOKEN": ""}, "OMNI_TOKEN (the environment's --omni-token)"),
    (["drain", "--master", "127.0.0.1:1", "--omni-token", ""], None, "--omni-token is empty"),
    (["wakeup", "--master", "127.0.0.1:1"], {"OMNI_TOKEN": ""}, "OMNI_TOKEN (the environment's --omni-token)"),
    (["serve", "smollm2", "--dry-run", "--omni-token", ""], None, "--omni-token is empty"),
    (["serve", "smollm2", "--stage-id", "1", "--headless", "--omni-master-address", "127.0.0.1",
      "--omni-master-port", "1"], {"OMNI_TOKEN": ""}, "OMNI_TOKEN (the environment's --omni-token) is empty"),
])
def test_an_empty_token_is_refused_by_name(args, env, message):
    r = omni(*args, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr and "give a token, or leave it unset for no auth" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_token_still_reaches_the_command(monkeypatch):
    """The check wraps the commands: typer still sees their options (help, values)."""
    r = omni("status", "--help")
    assert r.returncode == 0 and "--omni-token" in r.stdout and "--watch" in r.stdout
    r = omni("status", "--master", "127.0.0.1:1", "--omni-token", "t")
    assert r.returncode == 2 and "cannot reach the omni master" in r.stderr, r.stderr
