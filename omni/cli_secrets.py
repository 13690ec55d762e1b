"""Secrets inside `omni serve`'s JSON flags, for the process title (omni.cli_argv.hide_secrets): engine args'
hf_token (vLLM's --hf-token) and a stage's env values, in --engine-args / --stage-overrides whole or dotted
(--engine-args.hf_token T, --stage-overrides.0.env.HF_TOKEN T). Masked as the master's shown config masks
them (omni.master.configdiff.shown): every env value, since any may be a secret."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["JSON_FLAGS", "MASK", "json_flag", "mask_json_flag"]

JSON_FLAGS = ("--engine-args", "--stage-overrides")
MASK = "***"
# env names worth a warning (all env values are masked; OMP_NUM_THREADS 4 needs no warning)
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)


def json_flag(name: str) -> str | None:
    """The JSON flag `name` is (itself or a dotted form of it), else None."""
    return next((f for f in JSON_FLAGS if name == f or name.startswith(f + ".")), None)


def _kind(base: str, path: list[str]) -> str | None:
    """'warn' (a secret), 'mask' (an env value: maybe a secret) or None for the value at `path` under `base`."""
    if base == "--engine-args":
        return "warn" if path == ["hf_token"] else None
    # --stage-overrides: {stage: {"hf_token": .., "engine_args": {"hf_token": ..}, "env": {NAME: ..}}}
    if path[1:] in (["hf_token"], ["engine_args", "hf_token"]):
        return "warn"
    if len(path) == 3 and path[1] == "env":
        return "warn" if _SECRET_NAME.search(path[2]) else "mask"
    return None


def _names_secret(text: str) -> bool:
    return "hf_token" in text or bool(_SECRET_NAME.search(text))


def _walk(base: str, path: list[str], value: Any, found: dict[str, str]) -> Any:
    kind = _kind(base, path)
    if kind:
        if kind == "warn":
            found[".".join([base, *path])] = "HF_TOKEN" if path[-1] == "hf_token" else f"{path[-1]} (the stages inherit it)"
        return MASK
    if isinstance(value, dict):
        return {k: _walk(base, [*path, str(k)], v, found) for k, v in value.items()}
    return value


def mask_json_flag(name: str, text: str) -> tuple[str, dict[str, str]]:
    """(`text`, the value of JSON flag `name`, with its secrets masked; {each secret's dotted flag: the variable
    to set instead}, to warn about).
    A value that is not JSON is kept unless it names a secret: then it is masked whole (its error quotes it)."""
    base = json_flag(name)
    assert base is not None, name
    prefix = [k for k in name[len(base) + 1:].split(".") if k] if name != base else []
    try:
        value = json.loads(text)
    except ValueError:
        if not prefix:  # not JSON: refused later, quoting it
            return (MASK, {base: "HF_TOKEN (or the variable)"}) if _names_secret(text) else (text, {})
        value = text    # a dotted form's plain word (--engine-args.hf_token hf_abc)
    found: dict[str, str] = {}
    masked = _walk(base, prefix, value, found)
    if masked == value:
        return text, found
    return (MASK if masked == MASK else json.dumps(masked)), found
