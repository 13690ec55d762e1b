"""Load one Qwen3-Omni stage from a checkpoint folder, reading only its own tensors (prefixes
`thinker.`, `talker.`, `code2wav.`; omni/models/checkpoint.py), so the talker and code2wav stages
never touch the thinker's 59 GiB."""

from __future__ import annotations

from pathlib import Path

import torch

from omni.engines.base import EngineError
from omni.models.checkpoint import EMBED_KEY, build_module, load_prefix, resolve_dtype

__all__ = ["EMBED_KEY", "load_code2wav", "load_config", "load_prefix", "load_talker"]


def load_config(folder: str | Path):
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise EngineError(f"{folder}: no config.json")
    config = AutoConfig.from_pretrained(folder)
    if type(config).__name__ != "Qwen3OmniMoeConfig":
        raise EngineError(f"{folder}: config is {type(config).__name__}, expected Qwen3OmniMoeConfig")
    return config


def load_talker(folder: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str = "cpu"):
    """(config, talker module, thinker token embedding table [V, H]) for the talker stage."""
    from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

    config = load_config(folder)
    dt = resolve_dtype(dtype, config)
    talker = build_module(Qwen3OmniMoeTalkerForConditionalGeneration, config.talker_config,
                          load_prefix(folder, "talker."), dt, f"{folder} talker")
    embed = load_prefix(folder, "thinker.", names={EMBED_KEY})["model.embed_tokens.weight"].to(dt)
    return config, talker.to(device), embed.to(device)


def load_code2wav(folder: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str = "cpu"):
    """(config, code2wav module) for the code2wav stage."""
    from transformers import Qwen3OmniMoeCode2Wav

    config = load_config(folder)
    dt = resolve_dtype(dtype, config)
    model = build_module(Qwen3OmniMoeCode2Wav, config.code2wav_config, load_prefix(folder, "code2wav."), dt,
                         f"{folder} code2wav")
    return config, model.to(device)
