"""vLLM / vllm-omni users' flags and deploy YAML work on omni (issue 15, item 1)."""

import json
import subprocess
import sys

import pytest

from omni import config as cfg
from omni.engines.factory import accepted_args, engine_args_for
from omni.errors import ConfigError
from tests.e2e.harness import REPO


def dry_run(*args: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", *args, "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    return ({s["stage_id"]: s["engine_args"] for s in out["config"]["stages"]}
            | {"flags": out["engine_flags"], "num_replicas": out["num_replicas"]}, r.stderr)


def test_vllm_serve_flags_are_accepted_and_spread_over_the_stages_that_take_them():
    args, err = dry_run("smollm2", "--omni", "--max-model-len", "512", "-tp", "1", "--trust-remote-code",
                        "--max-num-seqs", "4", "--dtype", "float32")
    assert args[0]["max_model_len"] == 512 and args[0]["max_num_seqs"] == 4 and args[0]["dtype"] == "float32"
    plain = dry_run("smollm2", "--num-replicas", "2")[0]
    assert plain["num_replicas"] == 2
    assert args[1] == plain[1] and args[2] == plain[2]   # what the deploy file gives them, nothing of the flags
    assert "not to stage 1 (talker), stage 2 (code2wav)" in err


def test_a_gpu_only_flag_no_cpu_stage_takes_is_named_not_crashed_on():
    args, err = dry_run("smollm2", "--gpu-memory-utilization", "0.5", "--enforce-eager")
    assert "--gpu-memory-utilization: no stage of this pipeline takes it" in err
    assert "gpu_memory_utilization" not in args[0]


@pytest.mark.parametrize("flags, message", [
    (["-tp", "2"], "--tensor-parallel-size: no stage of this pipeline takes it (stage 0 (thinker): torch_lm"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: no stage of this pipeline takes it"),
    (["--no-such-flag"], "--no-such-flag: no stage of this pipeline takes it"),   # was named --such-flag
])
def test_a_flag_no_stage_takes_is_an_error_naming_flag_and_stages(flags, message):
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", *flags, "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_omni_dp_size_local_counts_the_stage_ids_replicas_and_needs_it_as_in_vllm_omni():
    """vllm-omni's --omni-dp-size-local is this process's replicas of its --stage-id; other than 1 without one
    it refuses. omni took it as --num-replicas and ran N replicas of every stage."""
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--omni-dp-size-local", "2",
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--omni-dp-size-local != 1 requires --stage-id to be set" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    head = ("--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", "1")
    assert dry_run("smollm2", *head, "--omni-dp-size-local", "2")[0]["num_replicas"] == 2
    assert dry_run("smollm2", "--omni-dp-size-local", "1")[0]["num_replicas"] is None    # vllm-omni's default


@pytest.mark.parametrize("given, message", [
    ((None, 0, 1), "--omni-dp-size-local must be >= 1, got 0"),
    ((2, 3, 1), "--num-replicas 2 and --omni-dp-size-local 3 both count this stage's replicas; pass one"),
])
def test_a_bad_omni_dp_size_local_is_named(given, message):
    from omni.serve_modes import replicas

    with pytest.raises(ConfigError, match=message):
        replicas(*given)
    assert replicas(2, 2, 1) == 2 and replicas(3, None, None) == 3 and replicas(None, 1, None) is None


def test_stage_mode_flags_stay_per_replica():
    args, err = dry_run("smollm2", "--stage-id", "1", "--headless", "--omni-master-address", "127.0.0.1",
                        "--omni-master-port", "1", "--threads", "2", "--gpu-memory-utilization", "0.5")
    assert args["flags"] == {"threads": 2} and "threads" not in args[1]
    # as in single-command mode: GPU sizing the stage's engine does not take is named and dropped
    assert "--gpu-memory-utilization: stage 1's engine (piper_talker) does not take it; ignored" in err


def test_a_stage_drops_gpu_args_its_engine_does_not_take(capsys):
    """The seed's --stage-overrides '{"1": {"gpu_memory_utilization": 0.5}}' on the Piper talker."""
    config = cfg.load("smollm2", None, {"1": {"gpu_memory_utilization": 0.5, "threads": 2}})
    assert engine_args_for(config.stage(1)) == {"threads": 2}
    assert "stage 1 (talker): engine piper_talker does not take gpu_memory_utilization" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"stages\[1\].engine_args.thread: engine piper_talker does not take it"):
        cfg.load("smollm2", None, {"1": {"thread": 2}})      # at load (config_engines), not at the stage's start
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is not supported"):
        cfg.load("smollm2", None, {"0": {"tensor_parallel_size": 2}})


def test_engines_say_which_args_they_take():
    assert {"max_model_len", "dtype", "max_num_seqs"} <= accepted_args("torch_lm")
    assert "threads" in accepted_args("piper_talker")
    assert accepted_args("hidden_pooler") == frozenset()


def test_flat_stage_keys_as_in_vllm_omni_yaml(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("""
model: local
stages:
  - stage_id: 0
    engine: torch_lm
    max_model_len: 512
    gpu_memory_utilization: 0.8
    engine_args: {dtype: float32}
    final_output: true
    final_output_type: text
platforms:
  cpu:
    stages:
      - stage_id: 0
        max_num_seqs: 2
""")
    config = cfg.load("x", str(path))
    assert config.stage(0).engine_args == {"max_model_len": 512, "gpu_memory_utilization": 0.8,
                                           "dtype": "float32", "max_num_seqs": 2}


def test_the_bundled_cpu_vllm_stage_runs_in_float32(monkeypatch):
    """bfloat16 greedy answers differ between CPU kinds (issue 15, item 7)."""
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    assert cfg.load("smollm2-vllm").stage(0).engine_args["dtype"] == "float32"


def test_omni_version():
    r = subprocess.run([sys.executable, "-m", "omni.cli", "--version"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("omni ") and r.stdout.split()[1][0].isdigit(), r
