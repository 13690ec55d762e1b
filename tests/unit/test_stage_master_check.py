"""A headless stage asks the master once, before loading its engine, whether it would take this replica:
a refused token or another pipeline config fail at once, not after a load of seconds to minutes. A master
that does not answer yet is waited for by the registration, as before (--init-timeout bounds that wait)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from omni import config as cfg
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from omni.stage.main import StageOptions, master_refusal
from tests.e2e.harness import REPO

CONFIG = cfg.load("HuggingFaceTB/SmolLM2-135M-Instruct")


def _master(config: dict, token: str | None = "RIGHT") -> MasterServer:
    server = MasterServer(config, hash_config(config), token=token)
    server.start()
    return server


@pytest.fixture
def master():
    servers = []

    def start(config: dict | None = None, token: str | None = "RIGHT") -> str:
        servers.append(_master(config or CONFIG.to_dict(), token))
        return servers[-1].address
    yield start
    for s in servers:
        s.stop(grace=0.2)


def test_a_wrong_token_and_a_right_one(master):
    address = master()
    assert "missing or wrong omni token" in master_refusal(CONFIG, 0, StageOptions(address, token="WRONG"))
    assert "no omni token sent" in master_refusal(CONFIG, 0, StageOptions(address))
    assert master_refusal(CONFIG, 0, StageOptions(address, token="RIGHT")) is None


def test_another_config_is_named_and_env_values_are_not(master):
    other = CONFIG.to_dict()
    other["stages"][0]["engine_args"]["max_num_seqs"] = 3
    why = master_refusal(CONFIG, 0, StageOptions(master(other), token="RIGHT"))
    assert "stage 0 config differs from the master's" in why and "engine_args.max_num_seqs: master=3 replica=8" in why
    other = CONFIG.to_dict()
    other["stages"][1]["env"] = {"HF_TOKEN": "hf_SECRET"}
    why = master_refusal(CONFIG, 0, StageOptions(master(other), token="RIGHT"))
    assert "hf_SECRET" not in why and "stage 1: env.HF_TOKEN" in why


def test_a_master_not_up_yet_is_left_to_the_registration():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: refused at once
        assert master_refusal(CONFIG, 0, StageOptions(f"127.0.0.1:{port}", token="T")) is None


def test_a_wrong_token_fails_the_headless_stage_before_its_engine_loads(master):
    address = master()
    host, port = address.rsplit(":", 1)
    env = {**os.environ, "OMNI_TOKEN": "WRONG"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--stage-id",
                        "0", "--headless", "--omni-master-address", host, "--omni-master-port", port], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "missing or wrong omni token" in r.stderr and "the engine is not loaded" in r.stderr, r.stderr
    assert "loading engine" not in r.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("flag, wait_s", [([], 120.0), (["--init-timeout", "7"], 7.0),
                                          (["--stage-init-timeout", "9"], 9.0)])
def test_init_timeout_bounds_the_wait_for_the_master(monkeypatch, flag, wait_s):
    from typer.testing import CliRunner

    from omni import cli_argv
    from omni.cli import app
    from omni.stage import main

    seen = {}
    monkeypatch.setattr(main, "run_stage", lambda config, stage_id, opts, engine_flags: seen.setdefault("o", opts) and 0)
    monkeypatch.setattr(cli_argv, "reexec_with_env", lambda env: None)
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    r = CliRunner().invoke(app, ["serve", "smollm2", "--stage-id", "1", "--headless", "--omni-master-address",
                                 "127.0.0.1", "--omni-master-port", "1", *flag])
    assert r.exit_code == 0, (r.output, r.exception)
    assert seen["o"].register_wait_s == wait_s
