"""vLLM's --hf-token is a secret: masked in the process title and in error messages, and it reaches the
stages as HF_TOKEN in their environment, never on a child's argv (--engine-flags) nor in the hashed
config the master shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO

SECRET = "hf_SECRETX"


def test_hf_token_is_masked_in_the_title_with_a_warning(capsys):
    from omni.cli_argv import hide_secrets, mask_in_message

    assert hide_secrets(["serve", "m", "--hf-token", SECRET, "--port", "1"]) == \
        ["serve", "m", "--hf-token", "***", "--port", "1"]
    assert hide_secrets(["serve", "m", f"--hf-token={SECRET}"]) == ["serve", "m", "--hf-token=***"]
    # bare (the saved login token): the next flag is not its value
    assert hide_secrets(["serve", "m", "--hf-token", "--port", "1"]) == ["serve", "m", "--hf-token", "--port", "1"]
    assert "HF_TOKEN" in capsys.readouterr().err
    assert mask_in_message(f"bad {SECRET!r}", ["serve", "m", "--hf-token", SECRET]) == "bad '***'"
    assert mask_in_message("bad '--port'", ["serve", "m", "--hf-token", "--port", "1"]) == "bad '--port'"


@pytest.fixture
def planned(monkeypatch) -> list:
    """`omni serve` only plans its children; the launchers' plans and children land here."""
    from omni.launcher import Launcher

    seen = []

    def plan_only(self):
        self._plan_children()
        seen.append((self.plan, list(self.children)))
        self.shutdown()
        return 0

    monkeypatch.setattr(Launcher, "run", plan_only)
    monkeypatch.setenv("HF_TOKEN", "before")   # put back after the test
    return seen


@pytest.mark.parametrize("args", [
    ["serve", "smollm2", "--port", "0", "--hf-token", SECRET],
    ["serve", "smollm2", "--port", "0", "--engine-args", json.dumps({"hf_token": SECRET})],
    ["serve", "smollm2", "--stage-id", "1", "--headless", "--num-replicas", "2", "--omni-master-address",
     "127.0.0.1", "--omni-master-port", "1", f"--hf-token={SECRET}", "--max-num-seqs", "2"],
])
def test_hf_token_reaches_the_stages_by_environment_only(planned, args):
    from typer.testing import CliRunner

    from omni.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (r.output, r.exception)
    [(plan, children)] = planned
    assert [c for c in children if c.kind == "stage"]
    for child in children:
        assert not any(SECRET in a for a in child.argv), child.argv
        assert (child.env or os.environ)["HF_TOKEN"] == SECRET
    assert SECRET not in json.dumps(plan.config.to_dict()) and "hf_token" not in plan.engine_flags


def test_dry_run_shows_no_hf_token_and_a_bad_value_is_refused_by_name():
    def omni(*args):
        return subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--dry-run", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    r = omni("--hf-token", SECRET)
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout and "hf_token" not in json.dumps(json.loads(r.stdout)["engine_flags"])
    r = omni("--hf-token", "--max-num-seqs", "2")   # bare: the saved token; still a dry run
    assert r.returncode == 0, r.stderr
    r = omni("--no-hf-token")
    assert r.returncode == 2 and "--hf-token: expected a Hugging Face token" in r.stderr, r.stderr
