"""A stage pinned to GPUs its process cannot see fails at start naming stages[i].devices; it ran on the CPU
unsaid (devices "1" on a one-GPU host: CUDA_VISIBLE_DEVICES=1 hides every GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni.errors import ConfigError
from omni.stage import gpus
from tests.e2e.harness import REPO

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def check(devices, platform="cuda", seen=(0, None), outer=None, stage_id=1):
    said: list[str] = []
    gpus.check_gpus(stage_id, f"stage {stage_id}", devices, outer, platform, said.append, count=lambda: seen)
    return said


def test_a_stage_naming_more_gpus_than_it_sees_is_refused(monkeypatch):
    monkeypatch.setattr(gpus, "host_gpus", lambda: 1)
    with pytest.raises(ConfigError) as e:
        check("1")   # select_devices made it CUDA_VISIBLE_DEVICES=1 on a one-GPU host
    msg = str(e.value)
    assert msg.startswith("stages[1].devices '1' names 1 GPU(s), but the stage's process sees 0: this host has 1 "
                          "NVIDIA GPU(s); "), msg
    assert "--deploy-config qwen3-omni-moe-1gpu" in msg and "devices to cpu" in msg
    with pytest.raises(ConfigError, match=r"stages\[0\]\.devices '0,1' names 2 GPU\(s\), but the stage's process "
                                          r"sees 1: this host has 1 NVIDIA GPU\(s\) and CUDA_VISIBLE_DEVICES was '3'"):
        check("0,1", seen=(1, None), outer="3", stage_id=0)
    assert check("0,1", seen=(2, None)) == []
    assert check("1", seen=(1, None)) == []


def test_cpu_and_unpinned_stages_are_not_asked():
    def count():
        raise AssertionError("counted")
    for devices in ("cpu", ""):
        gpus.check_gpus(0, "stage 0", devices, None, "cuda", print, count=count)


def test_without_an_nvidia_gpu_the_bundled_gpu_indices_run_on_the_cpu_with_a_note(monkeypatch):
    """The bundled Qwen deploys keep devices "0"/"1" in their CPU platform section: they must still run."""
    monkeypatch.setattr(gpus, "host_gpus", lambda: 0)
    assert check("1", platform="cpu") == ["stage 1: stages[1].devices '1' names a GPU, but this host has no "
                                          "NVIDIA GPU: the stage runs on the CPU"]
    monkeypatch.setattr(gpus, "host_gpus", lambda: 2)   # OMNI_PLATFORM=cpu on a GPU host: the user's choice
    assert check("1", platform="cpu") == []


def test_a_torch_without_cuda_sees_no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    seen, why = gpus.visible_gpus()
    assert seen == 0 and why == f"torch {torch.__version__} here is built without CUDA"


def test_a_pinned_stage_without_its_gpu_exits_before_loading(tmp_path):
    """The real start: a headless stage (in the CLI's process) on a cuda platform, devices "0" and no GPU it
    can use here, is one line naming stages[0].devices and exit 1, before the engine loads (it loaded on the
    CPU and then waited for the master)."""
    overlay = tmp_path / "gpu.yaml"
    overlay.write_text('stages:\n  - {stage_id: 0, devices: "0"}\n')
    env = {**os.environ, "OMNI_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": "63"}   # GPU 0 of the stage: none here
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", SMOLLM2, "--deploy-config", str(overlay),
                        "--stage-id", "0", "--headless", "--omni-master-address", "127.0.0.1",
                        "--omni-master-port", "9"], cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 1, r.stderr
    assert "stage 0 (thinker): stages[0].devices '0' names 1 GPU(s), but the stage's process sees 0" in r.stderr
    assert "the engine is not loaded" in r.stderr and "loading engine" not in r.stderr, r.stderr
