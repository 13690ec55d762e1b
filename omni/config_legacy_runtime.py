"""The top-level `runtime:` block of vllm-omni's legacy stage configs (its qwen2_5_omni.yaml): `enabled`,
`defaults.window_size` / `defaults.max_inflight` and `edges`. max_inflight (requests a stage holds at once)
is each stage's max_num_seqs where the stage sets none; window_size -1 (a stage starts once its upstream is
done) is dropped with a note, as omni hands pieces on as they come and the text and audio are the same; any
other window (a chunk size omni's connectors do not take) is refused by name."""

from __future__ import annotations

from typing import Any

from omni.config_stage_checks import is_count
from omni.errors import ConfigError

__all__ = ["apply_runtime"]

_WHOLE = -1     # vllm-omni: "trigger downstream only after full upstream completion"


def apply_runtime(value: Any, stages: list[dict[str, Any]], edges: set[tuple[int, int]],
                  source: str) -> list[str]:
    """Checks `runtime`, sets max_inflight on `stages` (omni stage overlays) that set no max_num_seqs of their
    own; `edges`: the file's (upstream, stage) pairs (engine_input_source). Returns what was dropped."""
    where = f"{source}: runtime"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping (enabled, defaults, edges)")
    _known(value, ("enabled", "defaults", "edges"), where)
    dropped = []
    if "enabled" in value:
        if not isinstance(value["enabled"], bool):
            raise ConfigError(f"{where}.enabled must be true or false, got {value['enabled']!r}")
        dropped.append("enabled")
    defaults = value.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}.defaults must be a mapping (window_size, max_inflight)")
    _known(defaults, ("window_size", "max_inflight"), f"{where}.defaults")
    windows = [_window(defaults, f"{where}.defaults")]
    if "max_inflight" in defaults:
        n = defaults["max_inflight"]
        if not is_count(n):
            raise ConfigError(f"{where}.defaults.max_inflight must be an integer >= 1, got {n!r}")
        for stage in stages:
            args = stage.setdefault("engine_args", {})
            if isinstance(args, dict):
                args.setdefault("max_num_seqs", n)
    listed = value.get("edges") or []
    if not isinstance(listed, list):
        raise ConfigError(f"{where}.edges must be a list of {{from, to, window_size}}")
    for i, edge in enumerate(listed):
        here = f"{where}.edges[{i}]"
        if not isinstance(edge, dict):
            raise ConfigError(f"{here} must be a mapping (from, to, window_size)")
        _known(edge, ("from", "to", "window_size"), here)
        ends = (edge.get("from"), edge.get("to"))
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
            raise ConfigError(f"{here}: from and to must be stage ids, got {ends[0]!r} -> {ends[1]!r}")
        if ends not in edges:
            raise ConfigError(f"{here}: {ends[0]} -> {ends[1]} is not an edge of stage_args (engine_input_source: "
                              f"{', '.join(f'{a} -> {b}' for a, b in sorted(edges)) or 'none'})")
        windows.append(_window(edge, here))
    if any(w is not None for w in windows):
        dropped.append("window_size -1 (omni hands each stage's output on as it comes; the same text and audio)")
    return dropped


def _window(entry: dict[str, Any], where: str) -> int | None:
    if "window_size" not in entry:
        return None
    w = entry["window_size"]
    if not isinstance(w, int) or isinstance(w, bool) or w != _WHOLE:
        raise ConfigError(f"{where}.window_size: {w!r} is not supported: omni hands each stage's output on as it "
                          "comes, in pieces its connectors size (-1, whole upstream, is read as that)")
    return w


def _known(entry: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (omni reads {', '.join(keys)})")
