"""Where the pipeline config leaves the master (GetStatus, `omni status --json`) or the CLI (--dry-run), a
stage's env values and its secret engine args (hf_token) are "***"; the keys stay, so one can see they are set."""

from __future__ import annotations

import json
import subprocess
import sys

from omni.master import configdiff
from omni.master.configdiff import hash_config, mismatch_message, shown
from tests.e2e.harness import REPO

SECRET = "hf_SECRETVALUE123"
CFG = {"model": "m", "stages": [
    {"stage_id": 0, "env": {"HF_TOKEN": SECRET, "OMP_NUM_THREADS": "1"}, "engine_args": {"hf_token": SECRET, "dtype": "x"}},
    {"stage_id": 1, "engine_args": {}}]}


def test_shown_masks_env_values_and_hf_token_and_leaves_the_config_alone():
    out = shown(CFG)
    assert SECRET not in json.dumps(out)
    assert out["stages"][0]["env"] == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "***"}
    assert out["stages"][0]["engine_args"] == {"hf_token": "***", "dtype": "x"}
    assert out["stages"][1] == CFG["stages"][1] and out["model"] == "m"
    assert CFG["stages"][0]["env"]["HF_TOKEN"] == SECRET   # a copy: the master's own config is intact


def test_a_differing_hf_token_is_neither_shown_nor_named():
    other = json.loads(json.dumps(CFG))
    other["stages"][0]["engine_args"]["hf_token"] = "hf_OTHER"
    msg = mismatch_message(CFG, other, 0, hash_config(CFG), hash_config(other))
    assert "the parts compared here are equal" in msg and "engine_args.hf_token are not compared here" in msg
    assert SECRET not in msg and "hf_OTHER" not in msg
    del other["stages"][0]["engine_args"]["hf_token"]
    assert SECRET not in configdiff.mismatch_message(CFG, other, 0, "a" * 64, "b" * 64)


def test_get_status_and_status_json_never_carry_env_values(monkeypatch, capsys):
    from omni.master.client import MasterClient
    from omni.master.commands import _show
    from omni.master.server import MasterServer

    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    try:
        with MasterClient(server.address, timeout_s=5.0) as client:
            st = client.get_status()
    finally:
        server.stop(grace=0.2)
    assert st.has_config and st.config_hash == hash_config(CFG)   # the hash is the real config's
    assert SECRET not in json.dumps(st.pipeline_config)
    assert st.pipeline_config["stages"][0]["env"] == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "***"}
    # The CLI masks what an older master sends in clear.
    import msgspec

    _show(msgspec.structs.replace(st, pipeline_config=CFG), json_=True, clear=False)
    out = capsys.readouterr().out
    assert SECRET not in out and '"HF_TOKEN": "***"' in out


def test_dry_run_masks_a_secret_engine_arg_from_stage_overrides():
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--dry-run", "--stage-overrides",
                        json.dumps({"0": {"engine_args": {"hf_token": SECRET}}})],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout and SECRET not in r.stderr
    assert json.loads(r.stdout)["config"]["stages"][0]["engine_args"]["hf_token"] == "***"


def test_register_with_the_status_hash_alone_gets_the_config_masked():
    """GetStatus shows the config hash; registering with only that hash must not hand back the env in clear.
    A registrant that sent the config itself (it holds the secrets) gets it whole."""
    from omni.master.client import MasterClient
    from omni.master.server import MasterServer

    server = MasterServer(CFG, hash_config(CFG))
    server.start()
    try:
        with MasterClient(server.address, timeout_s=5.0) as client:
            st = client.get_status()
            fe = client.register("FRONTEND", config_hash=st.config_hash, host="127.0.0.1", pid=1)
        with MasterClient(server.address, timeout_s=5.0) as client:
            stage = client.register("STAGE", 0, config_hash=st.config_hash, host="127.0.0.1", pid=2)
        with MasterClient(server.address, timeout_s=5.0) as client:
            own = client.register("STAGE", 0, config_hash=st.config_hash, pipeline_config=CFG, host="127.0.0.1", pid=3)
        with MasterClient(server.address, timeout_s=5.0) as client:
            masked = client.register("FRONTEND", config_hash=st.config_hash, pipeline_config=st.pipeline_config,
                                     host="127.0.0.1", pid=4)
    finally:
        server.stop(grace=0.2)
    for reg in (fe, stage, masked):
        assert SECRET not in json.dumps(reg.pipeline_config) + json.dumps(reg.stage_config)
        assert reg.pipeline_config == shown(CFG)
    assert stage.stage_config["env"] == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "***"}
    assert own.pipeline_config == CFG and own.stage_config == CFG["stages"][0]
