"""--omni-replica-address is the address a stage binds its listeners on and advertises: a wildcard
would open them on every interface (the stage channel answers anyone without --omni-token) and tell
peers to dial 0.0.0.0, so it is refused by name in every mode."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni.stage.main import is_wildcard
from tests.e2e.harness import REPO

MASTER = ["--omni-master-address", "127.0.0.1", "--omni-master-port", "1"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0:0::0", "0", "", " ", "::ffff:0.0.0.0",
                                  "[::ffff:0.0.0.0]", "0:0:0:0:0:ffff:0:0", "*"])
def test_wildcards(host):
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.5", "::1", "[fe80::1]", "node-1.example", "localhost",
                                  "::ffff:10.0.0.5"])
def test_addresses(host):
    assert not is_wildcard(host)


@pytest.mark.parametrize("mode", [
    [],                                                     # single-command
    ["--stage-id", "0", *MASTER],                           # the head
    ["--stage-id", "1", "--headless", *MASTER],             # a headless stage
    ["--stage-id", "1", "--headless", "--num-replicas", "2", *MASTER],   # the launcher's children
])
@pytest.mark.parametrize("flag", [["--omni-replica-address", "0.0.0.0"], ["-ora", "::"]])
def test_serve_refuses_a_wildcard_replica_address(mode, flag):
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", *flag, *mode, "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout
    assert f"--omni-replica-address '{flag[1]}' is a wildcard" in r.stderr


def test_serve_takes_an_address():
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--omni-replica-address", "127.0.0.1",
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


STAGE_GIVEN_A_WILDCARD = """
import sys
from omni.config import load
from omni.stage.main import StageOptions, run_stage
sys.exit(run_stage(load("smollm2"), 0, StageOptions(master_address="127.0.0.1:1", replica_address="0.0.0.0")))
"""


def test_a_stage_given_a_wildcard_exits_before_its_engine():
    """A launcher's child (omni.children --replica-address) or a caller of run_stage. In a process of its own:
    run_stage ends its process (os._exit within 3 s, after killing its descendants), the test run's too."""
    r = subprocess.run([sys.executable, "-c", STAGE_GIVEN_A_WILDCARD], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    assert "is a wildcard" in r.stderr and "loading engine" not in r.stderr


def _errors(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if not line.startswith("omni: warning:")]


@pytest.mark.parametrize("mode", [
    [],                                                     # single-command
    ["--stage-id", "0", *MASTER],                           # the head
    ["--stage-id", "1", "--headless", *MASTER],             # a headless stage
    ["--stage-id", "1", "--headless", "--num-replicas", "2", *MASTER],   # the launcher's children
])
@pytest.mark.parametrize("address", ["192.0.2.2", "node-1.invalid"])
def test_serve_refuses_an_address_beyond_loopback_without_a_token(mode, address, monkeypatch, capsys):
    """The stage's ZMQ ROUTER and tensor servers listened there with keys from the empty token: anyone
    reaching them got Welcome, sleep/wake_up/stats and AddRequest (inference around any --api-key)."""
    from omni.cli import main

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--omni-replica-address", address, *mode, "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"--omni-replica-address {address} opens this stage's listeners" in err and "--omni-token" in err, err
    assert len(_errors(err)) == 1, err
    monkeypatch.setenv("OMNI_TOKEN", "t0ken")
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--omni-replica-address", address, *mode, "--dry-run"])
    assert e.value.code == 0, capsys.readouterr().err


STAGE_BEYOND_LOOPBACK = """
import sys
from omni.config import load
from omni.stage import main as m
m.default_advertise_host = lambda master: "192.0.2.2"   # as on a host whose route to the master is a LAN
address = sys.argv[1] or None
sys.exit(m.run_stage(load("smollm2"), 0, m.StageOptions(master_address="127.0.0.1:1", replica_address=address)))
"""


@pytest.mark.parametrize("address", ["192.0.2.2", ""])
def test_a_stage_beyond_loopback_without_a_token_exits_before_its_engine(address):
    """A launcher's child given --replica-address, or a stage whose auto-detected address is on the network."""
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TOKEN"}
    r = subprocess.run([sys.executable, "-c", STAGE_BEYOND_LOOPBACK, address], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    assert "192.0.2.2" in r.stderr and "opens this stage's listeners" in r.stderr, r.stderr
    assert "--omni-token" in r.stderr and "loading engine" not in r.stderr, r.stderr


def test_dry_run_refuses_a_headless_stage_whose_picked_address_is_beyond_loopback(monkeypatch, capsys):
    """No --omni-replica-address: the stage picks the local address of the route to the master, and had been
    refused only once started (after the dry run passed)."""
    from omni.cli import main
    from omni.stage import main as stage_main

    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    monkeypatch.setattr(stage_main, "default_advertise_host", lambda master: "192.0.2.2")
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--stage-id", "1", "--headless", *MASTER, "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "192.0.2.2 (the local address of the route to the master" in err and "--omni-token" in err, err
    monkeypatch.setenv("OMNI_TOKEN", "t0ken")
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--stage-id", "1", "--headless", *MASTER, "--dry-run"])
    assert e.value.code == 0, capsys.readouterr().err
