"""An empty --omni-token / OMNI_TOKEN is refused by name in every command that takes it: empty, the master
would run without auth (and the clients send none), which a mistyped secret should never cause."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni.cli import main
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


@pytest.mark.parametrize("args, flag, swallowed", [
    (["--served-model-name", "--api-key", "SECRETzq"], "--served-model-name", "--api-key"),
    (["--api-key", "--served-model-name", "x"], "--api-key", "--served-model-name"),
    (["--omni-token", "--dry-run"], "--omni-token", "--dry-run"),
    (["--control-api-key", "--api-key=SECRETzq"], "--control-api-key", "--api-key"),
    (["--api-key", "--max-num-batched-tokens", "8"], "--api-key", "--max-num-batched-tokens"),  # an engine flag
    (["--stage-overrides", "--port", "0"], "--stage-overrides", "--port"),
])
def test_a_flag_is_never_taken_as_the_value_of_the_one_before(args, flag, swallowed, capsys):
    """`--served-model-name $NAME --api-key $KEY` with NAME empty served '--api-key' and KEY, with no key at all
    (and the key left readable in ps); `--omni-token $EMPTY --dry-run` started a server with the token
    '--dry-run'. vLLM's argparse refuses them; so does omni, naming the flag, the secret not shown."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", *args, "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and f"error: {flag}: no value given" in err and swallowed in err, err
    assert "SECRETzq" not in err


def test_a_value_that_only_starts_with_a_dash_is_still_a_value():
    from omni.cli_argv import spread_several_values

    assert spread_several_values(["serve", "m", "--api-key", "-k1", "--port", "-1"]) == \
        ["serve", "m", "--api-key", "-k1", "--port", "-1"]


@pytest.mark.parametrize("args, flag", [
    (["serve", "smollm2", "--dry-run", "--omni-master-address", "0.0.0.0",
      "--omni-replica-address", "127.0.0.1", "--tls-cert", "", "--tls-key", ""], "--tls-cert"),
    (["status", "--master", "127.0.0.1:1", "--tls-ca="], "--tls-ca"),
    (["drain", "--master", "127.0.0.1:1", "--tls-cert", "", "--tls-key", ""], "--tls-cert"),
    (["wakeup", "--master", "127.0.0.1:1", "--tls-key", ""], "--tls-key"),
    (["serve", "smollm2", "--dry-run", "--deploy-config", ""], "--deploy-config"),
    (["serve", "smollm2", "--dry-run", "--stage-configs-path="], "--stage-configs-path"),
])
def test_an_empty_tls_file_or_deploy_path_is_refused_by_name(args, flag, capsys, monkeypatch):
    """An empty --tls-* was read as unset: the master ran plaintext (and the clients connected so); an empty
    --deploy-config or --stage-configs-path served MODEL's bundled deploy. Both exited 0."""
    monkeypatch.setenv("OMNI_TOKEN", "s")   # the first case's master beyond loopback needs one
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f": {flag} is empty; give a" in err.splitlines()[-1] and "Traceback" not in err, err


@pytest.mark.parametrize("args, flag", [(["--tls-cert", "", "--tls-key", ""], "--tls-cert"),
                                        (["--deploy-config", ""], "--deploy-config")])
def test_omni_master_refuses_an_empty_tls_file_or_deploy_path(args, flag):
    """Before, `omni master --tls-cert ''` listened in plaintext (tls=False); --deploy-config '' adopted
    the first registrant's config."""
    try:
        r = subprocess.run([sys.executable, "-m", "omni.cli", "master", "--host", "127.0.0.1", "--port", "0",
                            *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"omni master {' '.join(args)} started (killed after 30 s)")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"omni master: {flag} is empty; give a"), r.stderr
