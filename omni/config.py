"""Deploy configs: YAML -> one typed, frozen, validated tree (its types: omni/config_types.py).

Resolution order (each step validated once, at the end):
  bundled YAML for the model, or for a model folder by its config.json `model_type`
  (or --deploy-config FILE | bundled name)
  -> base_config inheritance (deep merge, stages merged by stage_id), a base's `platforms.<cpu|cuda>`
     section applied before a user's file merges over it (the file's values win)
  -> `platforms.<cpu|cuda>` section of the YAML (merged the same way)
  -> --stage-overrides (single-command mode)
  => config hash (identifies the pipeline; every replica must match the head)
  -> per-stage engine flags (stage mode; that replica only, not hashed)
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from omni import config_legacy_stages as legacy_stages, config_vllm_omni as vllm_omni
from omni.config_engines import check_engines
from omni.config_checks import check_pipeline, check_sampling, check_talker_defaults, check_yaml_shape, yaml_sections
from omni.config_merge import deep_merge, merge_configs
from omni.config_stage_checks import (blame_override, check_connector_edge, check_engine_args, check_stage_override,
                                      normalise_stages, unused_engine_arg)
# The config's types (config_types.py), which most callers import from here.
from omni.config_types import STAGE_FIELDS, DeployConfig, StageConfig, config_hash, prompt_stage  # noqa: F401
from omni.digits import ascii_int
from omni.errors import ConfigError
# The config types of the image and video routes, kept where the rest of the deploy config is found.
from omni.media_settings import ImageSettings, PromptExpansion, VideoSettings, validate_images  # noqa: F401

DEPLOY_DIR = Path(__file__).resolve().parent / "deploy"   # package data: a wheel carries it (the root deploy/ links here)
TRANSPORTS = ("auto", "shm", "tcp", "gloo", "nccl", "cuda_ipc")
OUTPUT_TYPES = ("text", "audio", "embedding", "image", "video")


# ---------------------------------------------------------------- loading


def bundled_configs() -> dict[str, Path]:
    """Model id / alias (lower case) -> bundled deploy YAML."""
    table: dict[str, Path] = {}
    for path in sorted(DEPLOY_DIR.glob("*.yaml")):
        raw = _read_yaml(path)
        names = [raw.get("model", "")] + list(raw.get("aliases", []) or [])
        for name in names:
            if name and name != "local":   # "local": the model comes from the CLI
                table.setdefault(str(name).lower(), path)
    return table


def default_config_path(model: str) -> Path:
    table = bundled_configs()
    key = model.lower().rstrip("/")
    if key in table:
        return table[key]
    if os.path.isdir(model):
        return folder_config_path(Path(model))
    known = ", ".join(sorted({str(p.name) for p in table.values()}))
    raise ConfigError(
        f"no bundled deploy config for model {model!r}; pass --deploy-config FILE "
        f"(bundled: {known})"
    )


def folder_model_type(folder: Path) -> str:
    """`model_type` from a model folder's config.json, or a diffusers folder's pipeline class
    (model_index.json `_class_name`); one clear line when it cannot be read."""
    path = folder / "config.json"
    index = folder / "model_index.json"
    if not path.exists() and index.exists():
        path = index
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; a model folder needs its config.json") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return str(data.get("_class_name" if path == index else "model_type") or "")


def folder_config_path(folder: Path) -> Path:
    """A local model folder picks its pipeline by what it is (config.json `model_type`, the model
    family's entry in omni/models/registry.py); anything else is served as one torch_lm stage."""
    from omni.models import registry

    kind = folder_model_type(folder)
    if not (folder / "config.json").exists() and registry.folder_deploy(kind) == registry.FOLDER_FALLBACK:
        served = ", ".join(t for f in registry.FAMILIES for t in f.model_types if t[:1].isupper())
        raise ConfigError(f"{folder / 'model_index.json'}: diffusers pipeline {kind!r} is not one omni serves "
                          f"({served}); pass --deploy-config FILE")
    return DEPLOY_DIR / registry.folder_deploy(kind)


def deploy_config_path(name: str) -> Path:
    """--deploy-config: a YAML file, or the name of a bundled one (`qwen3-omni-moe-thinker-only`)."""
    path = Path(name)
    if path.exists() or path.suffix in (".yaml", ".yml") or os.sep in name:
        return vllm_omni.vllm_omni_deploy(name) or path
    bundled = DEPLOY_DIR / f"{name}.yaml"
    if bundled.is_file():
        return bundled
    if name in vllm_omni.BUNDLED:
        return vllm_omni.vllm_omni_deploy(name)
    known = ", ".join(sorted(p.stem for p in DEPLOY_DIR.glob("*.yaml")))
    raise ConfigError(f"--deploy-config: {name!r} is neither a file nor a bundled deploy config ({known})")


def current_platform() -> str:
    """"cuda" where an NVIDIA GPU is visible, else "cpu" (OMNI_PLATFORM overrides). Read without
    importing torch: config loading stays fast."""
    from omni import envs

    forced = envs.OMNI_PLATFORM
    if forced:
        return forced
    gpus = Path("/proc/driver/nvidia/gpus")
    return "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"


def apply_platform(data: dict[str, Any], platform: str, source: str) -> dict[str, Any]:
    """Merge the YAML's `platforms.<platform>` section (same shape as the top level) over it."""
    platforms = data.pop("platforms", None) or {}
    if not isinstance(platforms, dict):
        raise ConfigError(f"{source}: `platforms` must be a mapping of platform -> overrides")
    section = platforms.get(platform)
    if section is None:
        return data
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: `platforms.{platform}` must be a mapping")
    return merge_configs(data, section)


def nest_flat_engine_args(data: dict[str, Any]) -> dict[str, Any]:
    """vllm-omni's YAML puts engine args on the stage itself (flat); omni keeps them under
    `engine_args`. Stage keys that are not stage fields move there (`engine_args` wins)."""
    for _, section in yaml_sections(data):
        for stage in section.get("stages") or []:
            if not isinstance(stage, dict):
                continue
            flat = {k: stage.pop(k) for k in list(stage) if k not in STAGE_FIELDS}
            nested = stage.get("engine_args")
            if flat and nested is not None and not isinstance(nested, dict):
                stage.update(flat)   # leave it to validation to name the bad engine_args
            elif flat:
                stage["engine_args"] = {**flat, **(nested or {})}
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    from omni.config_yaml import safe_load   # bounded: aliases can stand for billions of nodes

    try:
        with open(path, encoding="utf-8") as f:
            data = safe_load(f, str(path))
    except FileNotFoundError:
        raise ConfigError(f"--deploy-config: file not found: {path}") from None
    except OSError as e:   # a directory, no permission ...
        raise ConfigError(f"{path}: cannot read the deploy config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a deploy config is YAML") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return check_yaml_shape({} if data is None else data, path)


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: base_config cycle: {' -> '.join(map(str, seen + (path,)))}")
    data = nest_flat_engine_args(vllm_omni.translate(_read_yaml(path), str(path)))
    base = data.get("base_config")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base_config must be a deploy YAML's path, got {base!r}")
    if base:
        base_path = Path(base)
        if not base_path.is_absolute():
            candidate = path.parent / base_path
            base_path = candidate if candidate.exists() else DEPLOY_DIR / base_path
        if not base_path.exists():
            base_path = vllm_omni.bundled_path(base_path) or base_path    # vllm-omni's qwen3_omni_moe.yaml
        parent = _load_raw(base_path, seen + (path,))
        data = merge_configs(_resolved_under(parent, path, base_path), data)
    return data


def _resolved_under(parent: dict[str, Any], child: Path, parent_path: Path) -> dict[str, Any]:
    """`parent` as `child` inherits it: under a user's file, with its platform section applied, so the file's own
    values win over a bundled CPU sizing; bundled variants keep one platform section with their bases."""
    if child.resolve().is_relative_to(DEPLOY_DIR):
        return parent
    return apply_platform(parent, current_platform(), str(parent_path))


def apply_stage_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`{"1": {"max_model_len": 1024, "engine": "vllm"}}`: stage fields set the field,
    anything else goes into that stage's engine_args."""
    if not isinstance(overrides, dict):
        raise ConfigError("--stage-overrides: expected a JSON object keyed by stage id")
    out = copy.deepcopy(data)
    stages = {s.get("stage_id"): s for s in out.get("stages", []) if isinstance(s, dict)}
    for key, patch in overrides.items():
        try:
            stage_id = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"--stage-overrides: key {key!r} is not a stage id") from None
        if stage_id not in stages:
            raise ConfigError(
                f"--stage-overrides: unknown stage {stage_id} (the pipeline has stages "
                f"{sorted(k for k in stages if isinstance(k, int))})"
            )
        if not isinstance(patch, dict):
            raise ConfigError(f"--stage-overrides: stage {stage_id}: expected an object")
        stage = stages[stage_id]
        for field, value in patch.items():
            if field == "stage_id":
                raise ConfigError("--stage-overrides: stage_id cannot be overridden")
            if field in STAGE_FIELDS:
                if isinstance(value, dict) and isinstance(stage.get(field), dict):
                    stage[field] = deep_merge(stage[field], value)
                else:
                    stage[field] = value
            else:
                stage.setdefault("engine_args", {})[field] = value
        check_stage_override(stage, patch, STAGE_FIELDS, f"--stage-overrides: stages[{stage_id}]")
    return out


def apply_engine_flags(config: DeployConfig, stage_id: int, flags: dict[str, Any]) -> DeployConfig:
    """Per-stage engine flags (stage mode): patch one stage's engine_args, unhashed."""
    flags = {k: v for k, v in flags.items() if v is not None}
    if not flags:
        return config
    unused = unused_engine_arg(flags)
    if unused:
        raise ConfigError(f"stage {stage_id}'s engine flags: {unused}")
    stages = []
    for s in config.stages:
        if s.stage_id == stage_id:
            s = msgspec.structs.replace(s, engine_args={**s.engine_args, **flags})
        stages.append(s)
    return msgspec.structs.replace(config, stages=tuple(stages))


def parse(data: dict[str, Any], source: str = "deploy config") -> DeployConfig:
    data = dict(data)
    data.pop("base_config", None)
    normalise_stages(data, source)
    try:
        config = msgspec.convert(data, DeployConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_yaml_path(str(e))}") from None
    validate(config, source)
    return config


def _yaml_path(message: str) -> str:
    # msgspec says "... - at `$.stages[0].foo`"; show the YAML key path.
    return message.replace("`$.", "`").replace("`$`", "the top level")


def validate(config: DeployConfig, source: str = "deploy config") -> None:
    ids = [s.stage_id for s in config.stages]
    if not ids:
        raise ConfigError(f"{source}: `stages` is empty")
    if sorted(ids) != list(range(len(ids))):
        raise ConfigError(f"{source}: stage ids must be contiguous from 0, got {ids}")
    if ids != sorted(ids):
        raise ConfigError(f"{source}: stages must be listed in stage_id order, got {ids}")
    for s in config.stages:
        where = f"{source}: stages[{s.stage_id}]"
        if s.num_replicas < 1:
            raise ConfigError(f"{where}.num_replicas must be >= 1, got {s.num_replicas}")
        check_sampling(s.default_sampling_params, where, s.engine)
        check_engine_args(s.engine_args, s.engine, f"{where}.engine_args")
        for i in s.inputs:
            if isinstance(i, int):
                if not 0 <= i < s.stage_id:
                    raise ConfigError(f"{where}.inputs: {i} is not an earlier stage")
            elif i not in ("prompt", "text"):
                raise ConfigError(f"{where}.inputs: {i!r} must be 'prompt', 'text' or a stage id")
        if s.upstream() and not s.processor:
            # Default: pass token ids / tensors through unchanged.
            pass
        if s.final_output and s.final_output_type not in OUTPUT_TYPES:
            raise ConfigError(
                f"{where}.final_output_type must be one of {list(OUTPUT_TYPES)}, "
                f"got {s.final_output_type!r}"
            )
        if not 0 <= s.first_output_hold_ms <= 10_000:
            raise ConfigError(f"{where}.first_output_hold_ms must be in [0, 10000], got {s.first_output_hold_ms}")
        if s.first_output_hold_ms and (s.final_output or not config.downstream(s.stage_id)):
            raise ConfigError(f"{where}.first_output_hold_ms: only a stage whose output feeds a later stage "
                              "(and is not itself a final output) can wait for the pipeline's first output")
        for edge, conn in s.connectors.items():
            if ascii_int(edge) not in ids:
                raise ConfigError(f"{where}.connectors: {edge!r} is not a stage id")
            check_connector_edge(config, s, edge, where)
            if conn.transport not in TRANSPORTS:
                raise ConfigError(
                    f"{where}.connectors.{edge}.transport must be one of {list(TRANSPORTS)}, "
                    f"got {conn.transport!r}"
                )
            if conn.arena_bytes is not None and conn.arena_bytes < 4096:
                raise ConfigError(f"{where}.connectors.{edge}.arena_bytes must be >= 4096, got {conn.arena_bytes}")
    if not any(s.final_output for s in config.stages):
        raise ConfigError(f"{source}: no stage has final_output: true")
    check_pipeline(config.pipeline, source)
    check_talker_defaults(config, source)   # reads the model's config.json: its talker's codec end
    dm = config.pipeline.default_modalities
    if not dm or not set(dm) <= {"text", "audio"} or ("audio" in dm and config.final_stage("audio") is None):
        raise ConfigError(f"{source}: pipeline.default_modalities must be text and/or audio (audio only with an "
                          f"audio stage), got {list(dm)}")
    entry = config.pipeline.speech_entry_stage
    if entry is not None and entry not in ids:
        raise ConfigError(f"{source}: pipeline.speech_entry_stage {entry} is not a stage id")
    validate_images(config.pipeline.images, f"{source}: pipeline.images")
    validate_images(config.pipeline.videos, f"{source}: pipeline.videos")
    validate_expansion(config, f"{source}: pipeline.images.expand")


def validate_expansion(config: DeployConfig, where: str) -> None:
    """`expand`: an LM at stage 0 writes the image stage's prompt from the chat the frontend renders."""
    expand = config.pipeline.images.expand
    if expand is None:
        return
    image = config.final_stage("image")
    if image is None or not image.upstream():
        raise ConfigError(f"{where}: needs an image stage fed by an earlier stage (the LM that writes its prompt)")
    if "prompt" not in config.stages[0].inputs:
        raise ConfigError(f"{where}: stage 0 must take the rendered chat (inputs: [prompt])")
    if "{prompt}" not in expand.user:
        raise ConfigError(f"{where}.user must hold {{prompt}} (where the client's prompt goes), got {expand.user!r}")


def load(
    model: str,
    deploy_config: str | None = None,
    stage_overrides: dict[str, Any] | None = None,
    async_chunk: bool | None = None,
    engines: bool = True,   # False: the engines are not checked (omni master: no torch, it builds none)
) -> DeployConfig:
    check = check_engines if engines else lambda config, _source: config
    path = deploy_config_path(deploy_config) if deploy_config else default_config_path(model)
    data = _load_raw(path)
    if "model" not in data and not any(isinstance(s, dict) and "engine" in s for s in data.get("stages") or []):
        pipeline = _pipeline_of(model, path)
        data = merge_configs(_resolved_under(_load_raw(pipeline), path, pipeline), data)
    roles = data.pop(legacy_stages.LEGACY_ROLES, None)
    if roles is not None:
        legacy_stages.check_roles(data.get("stages") or [], roles, str(path))
    data = apply_platform(data, current_platform(), str(path))
    source = str(path)
    if stage_overrides:
        stage_overrides, source = vllm_omni.lift_override_chunk(data, stage_overrides, source)
    vllm_omni.apply_carried(data, async_chunk, source)
    data["model"] = model   # the CLI's MODEL names the weights; the YAML the shape
    if stage_overrides:
        base, data = data, apply_stage_overrides(data, stage_overrides)
        try:
            return check(parse(data, source=str(path)), str(path))
        except ConfigError as e:
            check(parse(base, source=str(path)), str(path))   # the YAML's own error stays the YAML's
            raise blame_override(e, str(path), data.get("stages") or []) from None
    return check(parse(data, source=str(path)), str(path))


def _pipeline_of(model: str, path: Path) -> Path:
    """A deploy that names no model and whose stages name no engine (vllm-omni's deploy schema)
    overlays MODEL's bundled deploy, as vllm-omni's overlays the pipeline its model registers."""
    try:
        return default_config_path(model)
    except ConfigError:
        known = ", ".join(sorted({p.stem for p in bundled_configs().values()}))
        raise ConfigError(f"{path}: it names no model and its stages no engine (vllm-omni's deploy schema), so it "
                          f"overlays omni's bundled deploy for the model, and omni has none for {model!r} (bundled: "
                          f"{known}); name each stage's engine, or base_config: one of those") from None


def loads_json(blob: str | bytes) -> DeployConfig:
    """A resolved config handed to child processes (already merged and overridden)."""
    return parse(json.loads(blob), source="resolved config")
