"""Pure helpers: hash a pipeline config and say how two configs differ."""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


def hash_config(config: dict) -> str:
    """The pipeline's identity: the same hash `omni.config` computes for a resolved config."""
    from omni.config import config_hash

    return config_hash(config)


class _Hidden:
    """A stage's `env` value (it may hold a secret: HF_TOKEN ...): never shown, and not compared either: a
    line for each one that differs would confirm a registrant's guesses of the master's value one by one."""

    __hash__ = None

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hidden)

    def __str__(self) -> str:
        return "***"


# Engine args that hold a secret (vLLM's --hf-token): shown and compared as a stage's env values are.
SECRET_ENGINE_ARGS = ("hf_token",)
MASK = "***"
HIDDEN_NOTE = "a stage's env values and engine_args.hf_token are not compared here"


def _secret_args(stage: dict) -> dict | None:
    args = stage.get("engine_args")
    if isinstance(args, dict) and any(k in args for k in SECRET_ENGINE_ARGS):
        return args
    return None


def shown(config: dict) -> dict:
    """`config` as it may leave the master (GetStatus, `omni status --json`, --dry-run): each stage's
    env values and secret engine args as "***"; a copy, the stages' other fields unchanged."""
    if not isinstance(config, dict) or not isinstance(config.get("stages"), list):
        return config
    return {**config, "stages": [shown_stage(stage) for stage in config["stages"]]}


def shown_stage(stage: dict) -> dict:
    """One stage as `shown` gives it."""
    if not isinstance(stage, dict):
        return stage
    stage = dict(stage)
    if isinstance(stage.get("env"), dict):
        stage["env"] = dict.fromkeys(stage["env"], MASK)
    args = _secret_args(stage)
    if args is not None:
        stage["engine_args"] = {k: MASK if k in SECRET_ENGINE_ARGS else v for k, v in args.items()}
    return stage


def _show(value: Any) -> str:
    if value is _MISSING:
        return "<missing>"
    return json.dumps(value, sort_keys=True, default=str)


def diff_values(master: Any, replica: Any, path: str = "") -> list[str]:
    """Every differing leaf as 'path: master=X replica=Y' (dicts compared key by key, recursively; hidden
    values only by their presence)."""
    if isinstance(master, dict) and isinstance(replica, dict):
        out: list[str] = []
        for key in sorted(set(master) | set(replica), key=str):
            sub = f"{path}.{key}" if path else str(key)
            out += diff_values(master.get(key, _MISSING), replica.get(key, _MISSING), sub)
        return out
    if isinstance(master, list) and isinstance(replica, list) and len(master) == len(replica):
        out = []
        for i, (m, r) in enumerate(zip(master, replica)):
            out += diff_values(m, r, f"{path}[{i}]")
        return out
    if master is _MISSING and replica is _MISSING or master == replica:
        return []
    return [f"{path or '<root>'}: master={_show(master)} replica={_show(replica)}"]


def stages_by_id(config: dict) -> dict[int, dict]:
    """{stage_id: stage}; ValueError naming what is wrong with a config of another shape."""
    if not isinstance(config, dict):
        raise ValueError(f"pipeline config must be an object, got {type(config).__name__}")
    stages = config.get("stages")
    if not isinstance(stages, list):
        raise ValueError("pipeline config has no 'stages' list")
    out: dict[int, dict] = {}
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict) or "stage_id" not in stage:
            raise ValueError(f"pipeline config stages[{i}] has no 'stage_id'")
        try:
            out[int(stage["stage_id"])] = stage
        except (TypeError, ValueError):
            raise ValueError(f"pipeline config stages[{i}].stage_id must be an integer, got "
                             f"{stage['stage_id']!r}") from None
    return out


def diff_pipeline(master: dict, replica: dict, stage_id: int | None) -> list[str]:
    """Differences between two pipeline configs, the given stage's first.

    Stage fields are relative to the stage ('engine_args.max_model_len'); other stages are
    prefixed 'stage K:'; top-level pipeline fields keep their own names.
    """
    m_stages = _safe_stages(master)
    r_stages = _safe_stages(replica)
    out: list[str] = []
    if stage_id is not None:
        out += diff_values(m_stages.get(stage_id, _MISSING), r_stages.get(stage_id, _MISSING))
    for sid in sorted(set(m_stages) | set(r_stages)):
        if sid == stage_id:
            continue
        lines = diff_values(m_stages.get(sid, _MISSING), r_stages.get(sid, _MISSING))
        out += [f"stage {sid}: {line}" for line in lines]
    top_m = {k: v for k, v in master.items() if k != "stages"}
    top_r = {k: v for k, v in replica.items() if k != "stages"}
    out += diff_values(top_m, top_r)
    return out


def _safe_stages(config: dict) -> dict[int, dict]:
    try:
        stages = stages_by_id(config)
    except (ValueError, TypeError):
        return {}
    return {sid: _hidden(s) for sid, s in stages.items()}


def _hidden(stage: dict) -> dict:
    """The stage with its env values and secret engine args neither shown nor compared (their keys are)."""
    out = dict(stage)
    if isinstance(stage.get("env"), dict):
        out["env"] = {k: _Hidden(v) for k, v in stage["env"].items()}
    args = _secret_args(stage)
    if args is not None:
        out["engine_args"] = {k: _Hidden(v) if k in SECRET_ENGINE_ARGS else v for k, v in args.items()}
    return out


def mismatch_message(master: dict, replica: dict | None, stage_id: int | None,
                     master_hash: str, replica_hash: str) -> str:
    """The refusal text for a registrant whose config hash differs from the master's."""
    who = f"stage {stage_id}" if stage_id is not None else "frontend"
    head = f"{who} config differs from the master's"
    if replica is None:
        return (f"{head} (config_hash master={master_hash[:12]} replica={replica_hash[:12]}); "
                "the replica sent no pipeline_config_json to compare")
    lines = diff_pipeline(master, replica, stage_id)
    if not lines:
        # The same text whether a hidden value differs or not, so it confirms no guess of one.
        return (f"{head}: the parts compared here are equal but the hashes differ (master={master_hash[:12]} "
                f"replica={replica_hash[:12]}); {HIDDEN_NOTE}")
    return f"{head}: " + "; ".join(lines)
