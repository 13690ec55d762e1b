"""A master bound beyond loopback without --omni-token is refused (omni master --host; omni serve's
--omni-master-address where it hosts the master): anyone who reached it could register a fake stage or send
sleep and drain, while a stage's wildcard --omni-replica-address was already refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni.cli import main
from omni.errors import ConfigError
from omni.master.auth import is_loopback, refuse_open_master
from tests.e2e.harness import REPO


def _errors(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if not line.startswith("omni: warning:")]


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_omni_master_on_every_interface_without_a_token_exits_2_naming_both_flags(host):
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "omni.cli", "master", "--host", host, "--port", "0"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"--host {host} opens the master to other hosts" in r.stderr and "--omni-token" in r.stderr, r.stderr
    assert len(_errors(r.stderr)) == 1 and "listening" not in r.stdout, r.stderr


def _serve(*args: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--dry-run", *args])
    return e.value.code


@pytest.mark.parametrize("args", [
    ["--omni-master-address", "0.0.0.0"],
    ["--omni-master-address", "10.1.2.3", "--stage-id", "0", "--omni-master-port", "1"],
    ["--omni-master-address", "::", "--stage-id", "0", "--omni-master-port", "1", "--num-replicas", "0"],
])
def test_omni_serve_hosting_the_master_beyond_loopback_needs_a_token(args, monkeypatch, capsys):
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    assert _serve(*args) == 2
    err = capsys.readouterr().err
    assert f"--omni-master-address {args[1]} opens the master" in err and "--omni-token" in err, err
    assert len(_errors(err)) == 1, err
    monkeypatch.setenv("OMNI_TOKEN", "t0ken")
    assert _serve(*args) == 0, capsys.readouterr().err


@pytest.mark.parametrize("args", [
    [],                                                                  # the default: 127.0.0.1
    ["--omni-master-address", "127.0.0.1", "--stage-id", "0", "--omni-master-port", "1"],
    # a headless stage on one host; one whose route to the master leaves the host opens its listeners there
    # and needs one (test_replica_address)
    ["--omni-master-address", "127.0.0.1", "--stage-id", "1", "--headless", "--omni-master-port", "1"],
])
def test_loopback_masters_and_headless_stages_need_no_token(args, monkeypatch, capsys):
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    assert _serve(*args) == 0, capsys.readouterr().err


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("", False), ("0", False), ("10.0.0.1", False),
    ("::ffff:0.0.0.0", False),
])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback
    if loopback:
        refuse_open_master(host, None, "--host")
    else:
        with pytest.raises(ConfigError, match="--host"):
            refuse_open_master(host, None, "--host")
    refuse_open_master(host, "t0ken", "--host")      # with a token any address is the operator's choice


@pytest.mark.parametrize("command, flag", [(["master"], "--host"), (["serve"], "--omni-master-address"),
                                           (["serve"], "--omni-replica-address")])
def test_help_says_an_address_beyond_loopback_needs_a_token(command, flag):
    """omni master --help offered 0.0.0.0 with no word of the token it now needs."""
    import click
    from typer.main import get_command

    from omni.cli import app

    group = get_command(app)
    cmd = group.get_command(click.Context(group), command[0])
    opt = next(p for p in cmd.params if flag in p.opts)
    assert "beyond loopback: needs --omni-token" in opt.help, opt.help
