"""Load one Qwen3-Omni stage from a checkpoint folder, reading only its own tensors.

A Qwen3-Omni folder holds three models under the prefixes `thinker.`, `talker.`
and `code2wav.` (sharded safetensors with `model.safetensors.index.json`, or one
`model.safetensors`). A stage builds transformers' module for its part from the
folder's config.json and opens only the shards that hold that prefix, so the
talker and code2wav stages never touch the thinker's 59 GiB.
"""

from __future__ import annotations

import json
import re
import logging
from collections import defaultdict
from pathlib import Path

import torch

from omni.engines.base import EngineError

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED_KEY = "thinker.model.embed_tokens.weight"


def _dtype(name: str | torch.dtype | None, config) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        if isinstance(name, torch.dtype):
            return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"unknown dtype {name!r} (use float32, bfloat16 or float16)")
    return dtype


def shard_map(folder: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name for the folder."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise EngineError(f"{folder}: no {INDEX} or {SINGLE}")


def load_prefix(folder: str | Path, prefix: str, *, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors whose names start with `prefix` (the prefix stripped), opening only their shards.
    With `names`, only those full names (prefix included)."""
    from safetensors import safe_open

    folder = Path(folder)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in shard_map(folder).items():
        if name.startswith(prefix) and (names is None or name in names):
            by_shard[shard].append(name)
    if not by_shard:
        raise EngineError(f"{folder}: no tensors named {prefix}*")
    out = {}
    for shard, keys in sorted(by_shard.items()):
        with safe_open(folder / shard, framework="pt") as f:
            for k in keys:
                out[k[len(prefix):]] = f.get_tensor(k)
    logger.info("loaded %d tensors %s* from %d shard(s) of %s", len(out), prefix, len(by_shard), folder)
    return out


def load_config(folder: str | Path):
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise EngineError(f"{folder}: no config.json")
    config = AutoConfig.from_pretrained(folder)
    if type(config).__name__ != "Qwen3OmniMoeConfig":
        raise EngineError(f"{folder}: config is {type(config).__name__}, expected Qwen3OmniMoeConfig")
    return config


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`experts.E.{gate,up,down}_proj.weight`, how checkpoints store
    them) -> the fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] transformers'
    MoE modules hold."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups[m.group(1)][int(m.group(2))][m.group(3)] = t
    for base, experts in groups.items():
        order = sorted(experts)
        if order != list(range(len(order))) or any(len(experts[e]) != 3 for e in order):
            raise EngineError(f"{base}: incomplete expert weights (experts {order})")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate"], experts[e]["up"]], dim=0) for e in order])
        out[f"{base}.down_proj"] = torch.stack([experts[e]["down"] for e in order])
    return out


def _build(cls, sub_config, state: dict[str, torch.Tensor], dtype: torch.dtype, what: str):
    from transformers.initialization import no_init_weights

    with no_init_weights():   # the checkpoint overwrites every weight; skip the random init
        model = cls._from_config(sub_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(fuse_experts(state), strict=False)
    if missing and getattr(sub_config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k not in {n for n, _ in model.named_parameters()}]
    if missing or unexpected:
        raise EngineError(f"{what}: checkpoint does not match the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    return model.to(dtype).eval().requires_grad_(False)


def load_talker(folder: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str = "cpu"):
    """(config, talker module, thinker token embedding table [V, H]) for the talker stage."""
    from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

    config = load_config(folder)
    dt = _dtype(dtype, config)
    talker = _build(Qwen3OmniMoeTalkerForConditionalGeneration, config.talker_config,
                    load_prefix(folder, "talker."), dt, f"{folder} talker")
    embed = load_prefix(folder, "thinker.", names={EMBED_KEY})["model.embed_tokens.weight"].to(dt)
    return config, talker.to(device), embed.to(device)


def load_code2wav(folder: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str = "cpu"):
    """(config, code2wav module) for the code2wav stage."""
    from transformers import Qwen3OmniMoeCode2Wav

    config = load_config(folder)
    dt = _dtype(dtype, config)
    model = _build(Qwen3OmniMoeCode2Wav, config.code2wav_config, load_prefix(folder, "code2wav."), dt,
                   f"{folder} code2wav")
    return config, model.to(device)
