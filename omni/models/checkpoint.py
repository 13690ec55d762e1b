"""Omni checkpoints: one folder holding several models under name prefixes (`thinker.`, `talker.`,
`code2wav.` / `token2wav.`), sharded safetensors with `model.safetensors.index.json` or one
`model.safetensors`. A stage builds transformers' module for its part from the folder's config and
opens only the shards that hold its prefix, so the speech stages never touch the thinker's weights.
Shared by the Qwen3-Omni and Qwen2.5-Omni families.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch

from omni.engines.base import EngineError

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED_KEY = "thinker.model.embed_tokens.weight"


def resolve_dtype(name: str | torch.dtype | None, config) -> torch.dtype:
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


def build_module(cls, sub_config, state: dict[str, torch.Tensor], dtype: torch.dtype, what: str):
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
