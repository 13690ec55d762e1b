"""Engine flags with --stage-id (the head, a headless stage) are checked against that stage's engine by
single-command mode's rule (engine_flags.spread_flags), before anything starts: vllm-omni's options and
unknown flags were printed by --dry-run and failed a real run only once the engine was built."""

from __future__ import annotations

import json

import pytest

from omni.cli import main

MASTER = ["--omni-master-address", "127.0.0.1", "--omni-master-port", "1"]
HEAD = ["--stage-id", "0", *MASTER]
HEADLESS = ["--stage-id", "0", "--headless", *MASTER]


def serve(capsys, *args: str, dry_run: bool = True) -> tuple[int, dict | None, str]:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", *args, *(["--dry-run"] if dry_run else [])])
    out = capsys.readouterr()
    return e.value.code, json.loads(out.out) if e.value.code == 0 and dry_run else None, out.err


@pytest.mark.parametrize("mode", [HEAD, HEADLESS], ids=["head", "headless"])
@pytest.mark.parametrize("flag, message", [
    (["--no-guardrails"], "--no-guardrails: vllm-omni's orchestrator option, not supported"),
    (["--ulysses-degree", "2"], "--ulysses-degree: vllm-omni's diffusion option, not supported"),
    (["-dac", "{}"], "--diffusion-attention-config: vllm-omni's diffusion option, not supported"),
    (["--enable-server-load-tracking"], "--enable-server-load-tracking: vLLM's serve option, not supported"),
    (["--such-flag", "1"], "--such-flag: stage 0's engine (torch_lm) does not take it"),
    (["--engine-args", '{"thread": 2}'], "--thread: stage 0's engine (torch_lm) does not take it"),
])
def test_a_flag_the_stages_engine_does_not_take_is_refused_by_name(capsys, mode, flag, message):
    code, _, err = serve(capsys, *mode, *flag)
    assert code == 2 and f"omni: error: {message}" in err, err


def test_each_stage_is_checked_against_its_own_engine(capsys):
    code, _, err = serve(capsys, "--stage-id", "1", "--headless", *MASTER, "--such-flag", "2")
    assert code == 2 and "--such-flag: stage 1's engine (piper_talker) does not take it" in err, err
    code, out, err = serve(capsys, "--stage-id", "1", "--headless", *MASTER, "--threads", "2")
    assert code == 0 and out["engine_flags"] == {"threads": 2}, err


@pytest.mark.parametrize("flag", [["--max-num-seqs", "2"], ["--max-num-batched-tokens", "8k"], ["--seed", "0"],
                                  ["--kv-cache-dtype", "fp8"], ["--max-model-len", "4096"]])
def test_a_flag_another_engine_takes_is_named_and_dropped_as_a_shared_command_line_needs(capsys, flag):
    """One command line is often shared by every stage (vllm-omni's multi-node launch): a vLLM flag the
    stage's own engine lacks is named and dropped, as a deploy YAML's engine_args key is; df551f3 refused
    it, so stages 1 and 2 of such a launch exited 2."""
    code, out, err = serve(capsys, "--stage-id", "2", "--headless", *MASTER, *flag)
    assert code == 0, err
    assert out["engine_flags"] == {}
    assert f"{flag[0]}: stage 2's engine (piper_code2wav) does not take it; ignored" in err


def test_what_the_engine_takes_passes_and_gpu_sizing_is_named_and_dropped(capsys):
    code, out, err = serve(capsys, *HEADLESS, "--max-num-seqs", "3", "-tp", "1", "--gpu-memory-utilization", "0.5")
    assert code == 0, err
    assert out["engine_flags"] == {"max_num_seqs": 3}          # -tp 1: a no-op; the GPU sizing: ignored, named
    assert "--gpu-memory-utilization: stage 0's engine (torch_lm) does not take it; ignored" in err
    assert all(s["engine_args"].get("max_num_seqs") != 3 for s in out["config"]["stages"])   # per replica, unhashed


@pytest.mark.parametrize("mode", [HEAD, HEADLESS], ids=["head", "headless"])
def test_a_real_run_is_refused_before_anything_starts(capsys, monkeypatch, mode):
    """The head started its master and frontends, a headless stage waited for the master, and only the
    engine's TypeError ("unexpected keyword argument 'guardrails'") ended them."""
    import omni.launcher
    import omni.stage.main

    started = []
    monkeypatch.setattr(omni.launcher.Launcher, "run", lambda self: started.append("launcher") or 0)
    monkeypatch.setattr(omni.stage.main, "run_stage", lambda *a, **k: started.append("stage") or 0)
    code, _, err = serve(capsys, *mode, "--no-guardrails", dry_run=False)
    assert code == 2 and "--no-guardrails: vllm-omni's orchestrator option" in err, err
    assert started == []
