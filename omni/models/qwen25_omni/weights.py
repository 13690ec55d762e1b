"""Load one Qwen2.5-Omni stage from a checkpoint folder, reading only its own tensors.

A Qwen2.5-Omni folder holds three models under `thinker.`, `talker.` and `token2wav.`,
plus the voices in `spk_dict.pt` (older copies: `spk.pt`). The talker stage reads
`talker.*` and the thinker's token embedding table; the token2wav stage reads
`token2wav.*` (always float32: the DiT's ODE and BigVGAN are run in float32, as
transformers does) and the voices' conditioning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from omni.engines.base import EngineError
from omni.models.checkpoint import EMBED_KEY, build_module, load_prefix, resolve_dtype

logger = logging.getLogger(__name__)

SPEAKER_FILES = ("spk_dict.pt", "spk.pt")


def load_config(folder: str | Path):
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():
        raise EngineError(f"{folder}: no config.json")
    config = AutoConfig.from_pretrained(folder)
    if type(config).__name__ != "Qwen2_5OmniConfig":
        raise EngineError(f"{folder}: config is {type(config).__name__}, expected Qwen2_5OmniConfig")
    return config


def load_speakers(folder: str | Path) -> dict[str, dict]:
    """Voice name -> {"cond": [enc_emb_dim], "ref_mel": [1, T, mel], "bos_token": int}."""
    for name in SPEAKER_FILES:
        path = Path(folder) / name
        if path.is_file():
            table = torch.load(path, map_location="cpu", weights_only=True)
            break
    else:
        raise EngineError(f"{folder}: no {' or '.join(SPEAKER_FILES)} (the voices)")
    bad = [k for k, v in table.items() if not isinstance(v, dict) or not {"cond", "ref_mel", "bos_token"} <= set(v)]
    if bad:
        raise EngineError(f"{path}: voices {bad} lack cond / ref_mel / bos_token")
    return dict(table)


NORM_KEY = "thinker.model.norm.weight"


def load_talker(folder: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str = "cpu"):
    """(config, talker module, thinker token embedding table [V, H], thinker final norm) for the
    talker stage. The norm turns the thinker's pre-norm last-layer rows into the rows it reads."""
    from transformers import Qwen2_5OmniTalkerForConditionalGeneration
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRMSNorm

    config = load_config(folder)
    dt = resolve_dtype(dtype, config)
    talker = build_module(Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config,
                          load_prefix(folder, "talker."), dt, f"{folder} talker")
    thinker = load_prefix(folder, "thinker.", names={EMBED_KEY, NORM_KEY})
    text = config.thinker_config.text_config
    norm = Qwen2_5OmniRMSNorm(text.hidden_size, eps=text.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(thinker["model.norm.weight"])
    norm = norm.to(device, dt).eval().requires_grad_(False)
    return config, talker.to(device), thinker["model.embed_tokens.weight"].to(device, dt), norm


def load_token2wav(folder: str | Path, *, device: str = "cpu"):
    """(config, token2wav module in float32) for the token2wav stage."""
    from transformers import Qwen2_5OmniToken2WavModel

    config = load_config(folder)
    model = build_module(Qwen2_5OmniToken2WavModel, config.token2wav_config, load_prefix(folder, "token2wav."),
                         torch.float32, f"{folder} token2wav")
    return config, model.to(device)
