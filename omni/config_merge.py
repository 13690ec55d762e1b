"""Merging deploy YAML dicts: a child over its base_config, a `platforms.<name>` section over the top level."""

from __future__ import annotations

import copy
from typing import Any


def merge_configs(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge child over base; `stages` lists merge by stage_id."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        if key == "stages" and isinstance(value, list) and isinstance(out.get("stages"), list):
            by_id = {s.get("stage_id"): s for s in out["stages"] if isinstance(s, dict)}
            merged = []
            for s in value:
                if isinstance(s, dict) and s.get("stage_id") in by_id:
                    merged.append(deep_merge(by_id.pop(s["stage_id"]), s))
                else:
                    merged.append(s)
            out["stages"] = sorted(
                list(by_id.values()) + merged,
                key=lambda s: s.get("stage_id", 0) if isinstance(s, dict) else 0,
            )
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
