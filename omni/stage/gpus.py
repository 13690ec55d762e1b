"""Whether the GPUs a stage's `devices` name are there, asked in the stage process before its engine loads.

Without the check a stage pinned to a GPU its process cannot see (devices "1" on a one-GPU host: its
CUDA_VISIBLE_DEVICES=1 hides every GPU; a torch built without CUDA) loaded on the CPU unsaid, a 30B model
included. Where the host has no NVIDIA GPU at all (platform cpu), the bundled deploys keep their GPU
indices and run on the CPU: a note says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omni.errors import ConfigError

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")   # what omni.config.current_platform reads


def named_gpus(devices: str) -> list[str]:
    """The GPU indices a normalised `devices` names ("0,1"); [] for cpu and unpinned ("")."""
    devices = (devices or "").strip().lower()
    if devices in ("", "cpu"):
        return []
    return [d.strip() for d in devices.split(",") if d.strip()]


def host_gpus() -> int:
    try:
        return sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        return 0


def visible_gpus() -> tuple[int, str | None]:
    """(GPUs torch sees in this process, why none when torch has no CUDA). torch counts through NVML where it
    can, so CUDA stays uninitialised: vLLM may still fork its EngineCore."""
    import torch

    if torch.version.cuda is None:
        return 0, f"torch {torch.__version__} here is built without CUDA"
    return torch.cuda.device_count(), None


def check_gpus(stage_id: int, label: str, devices: str, outer: str | None, platform: str,
               say: Callable[[str], None], count: Callable[[], tuple[int, str | None]] | None = None) -> None:
    """Call once select_devices has made `devices` this process's CUDA_VISIBLE_DEVICES (`outer`: what it was
    before). ConfigError when the stage names more GPUs than it sees on a cuda platform."""
    wanted = named_gpus(devices)
    if not wanted or platform not in ("cpu", "cuda"):
        return
    where = f"stages[{stage_id}].devices {devices!r}"
    if platform == "cpu":   # OMNI_PLATFORM=cpu on a GPU host: the user's choice, unsaid
        if not host_gpus():
            say(f"{label}: {where} names a GPU, but this host has no NVIDIA GPU: the stage runs on the CPU")
        return
    seen, why = (count or visible_gpus)()
    if seen >= len(wanted):
        return
    if why is None:
        why = f"this host has {host_gpus()} NVIDIA GPU(s)" + (
            f" and CUDA_VISIBLE_DEVICES was {outer!r}" if outer is not None else "")
    raise ConfigError(
        f"{where} names {len(wanted)} GPU(s), but the stage's process sees {seen}: {why}; pin the stage to GPUs "
        "this host has (Qwen3-Omni on one GPU: --deploy-config qwen3-omni-moe-1gpu) or set its devices to cpu")
