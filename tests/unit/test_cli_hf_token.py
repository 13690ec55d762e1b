"""vLLM's --hf-token is a secret: masked in the process title and in error messages, and it reaches the
stages as HF_TOKEN in their environment, never on a child's argv (--engine-flags) nor in the hashed
config the master shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    # vLLM's underscore spelling is the same flag (it was taken as HF_TOKEN and left in the title)
    assert hide_secrets(["serve", "m", "--hf_token", SECRET]) == ["serve", "m", "--hf_token", "***"]
    assert hide_secrets(["serve", "m", f"--hf_token={SECRET}"]) == ["serve", "m", "--hf_token=***"]
    assert SECRET not in str(hide_secrets(["serve", "m", "--engine_args", f'{{"hf_token": "{SECRET}"}}']))
    assert mask_in_message(f"bad {SECRET!r}", ["serve", "m", "--hf_token", SECRET]) == "bad '***'"
    assert mask_in_message("bad '--port'", ["serve", "m", "--hf-token", "--port", "1"]) == "bad '--port'"
    bad_json = f"{{hf_token: {SECRET}}}"      # refused quoting the value: masked whole, as it names a secret
    assert mask_in_message(f"not valid JSON: {bad_json!r}", ["serve", "m", "--engine-args", bad_json]) == \
        "not valid JSON: '***'"


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


# `omni` stopped in main() right after its title is set (the next step folds the dotted flags).
_PARKED = ("import time\nfrom omni import cli\n"
           "def parked(argv):\n    print('parsed', flush=True)\n    time.sleep(60)\n"
           "cli.fold_dotted_args = parked\ncli.main()\n")


@pytest.mark.parametrize("args", [
    ["--engine-args", json.dumps({"hf_token": SECRET, "dtype": "float32"})],
    [f"--engine-args={json.dumps({'hf_token': SECRET})}"],
    ["--engine-args.hf_token", SECRET],
    ["--stage-overrides.0.env.HF_TOKEN", SECRET],
    ["--stage-overrides.1.engine_args.hf_token", SECRET],
    ["--stage-overrides", json.dumps({"1": {"env": {"MY_API_KEY": SECRET, "OMP_NUM_THREADS": "2"}}})],
])
def test_a_secret_inside_a_json_flag_is_off_the_process_command_line_with_a_warning(args):
    """hf_token in --engine-args and a stage's env in --stage-overrides, whole or dotted, are masked in
    /proc/PID/cmdline as --hf-token is, and warned about by the flag's dotted name."""
    pytest.importorskip("setproctitle")
    p = subprocess.Popen([sys.executable, "-c", _PARKED, "serve", "smollm2", "--port", "0", *args], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "parsed\n"     # EOF if it died
        cmdline = (Path("/proc") / str(p.pid) / "cmdline").read_bytes().decode()
    finally:
        p.kill()
        _, err = p.communicate(timeout=30)
    assert SECRET not in cmdline and "***" in cmdline, cmdline
    assert "--port" in cmdline and ("dtype" in cmdline) == ("dtype" in " ".join(args)), cmdline   # the rest stays
    assert SECRET not in err and "on the command line is visible to every user of this host" in err, err
    assert ("HF_TOKEN" if "MY_API_KEY" not in args[-1] else "MY_API_KEY") in err, err
