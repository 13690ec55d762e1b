"""--omni-replica-address is the address a stage binds its listeners on and advertises: a wildcard
would open them on every interface (the stage channel answers anyone without --omni-token) and tell
peers to dial 0.0.0.0, so it is refused by name in every mode."""

from __future__ import annotations

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
