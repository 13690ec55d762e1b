"""vLLM-style engine flags on `omni serve` (--max-model-len, -tp, --trust-remote-code, any
EngineArgs field as --some-field VALUE): parsed from the command line and, in single-command
mode, spread over the stages whose engine takes them."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from omni import vllm_omni_flags
from omni.config import DeployConfig
from omni.errors import ConfigError


_SIZE = re.compile(r"^(?:(\d+)([KMG]?)|(\d+(?:\.\d+)?)([kmg]))$")


def context_length(value: str | None) -> int | None:
    """--max-model-len as vLLM reads it: 2048, 32k (32000), 32K (32768); "auto" / -1 (the most the
    engine fits) is refused by name, as omni's engines take a number."""
    if value is None:
        return None
    m = _SIZE.match(value.strip())
    if m is None:
        why = ("vLLM's auto (the most that fits) needs a number here" if value.strip() in ("auto", "-1")
               else "takes a token count: 2048, 32k (32000) or 32K (32768)")
        raise ConfigError(f"--max-model-len {value}: {why}")
    if m.group(1) is not None:
        n = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    else:
        n = int(float(m.group(3)) * {"k": 10**3, "m": 10**6, "g": 10**9}[m.group(4)])
    if n < 1:
        raise ConfigError(f"--max-model-len {value}: must be at least 1")
    return n


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def parse_extra_flags(args: list[str]) -> dict[str, Any]:
    """`--kv-cache-dtype fp8 --enable-prefix-caching --block-size=16` -> engine args
    (values read as JSON where they parse, else strings; a bare flag is true)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        if name.startswith("no-") and not eq and value == "true":
            name, value = name[3:], "false"
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out[name.replace("-", "_")] = parsed
        i += 1
    return out


def _describe(config: DeployConfig) -> str:
    return ", ".join(f"{s.label}: {s.engine}" for s in config.stages)


def spread_flags(config: DeployConfig, flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Single-command mode: {stage id: {arg: value}} for every stage whose engine takes each
    flag. A flag no stage takes is an error naming it and the stages, except flags that only
    size a GPU engine, which are named and ignored."""
    from omni.engines.factory import DEVICE_ONLY_ARGS, accepted_args, takes

    accepted = {s.engine: accepted_args(s.engine) for s in config.stages}
    out: dict[str, dict[str, Any]] = {}
    for key, value in flags.items():
        # None: an engine that takes any keyword (it ignores them), or vLLM not installed here.
        takers = [s for s in config.stages
                  if (s.engine == "vllm" if accepted[s.engine] is None
                      else takes(s.engine, key, value, accepted[s.engine]))]
        if not takers:
            if key in DEVICE_ONLY_ARGS or key == "enable_sleep_mode":   # omni's own engines sleep without it
                print(f"omni: {flag_name(key)}: no stage of this pipeline takes it ({_describe(config)}); "
                      "ignored", file=sys.stderr, flush=True)
                continue
            raise ConfigError(vllm_omni_flags.refusal(key)
                              or f"{flag_name(key)}: no stage of this pipeline takes it ({_describe(config)})")
        others = [s.label for s in config.stages if s not in takers]
        if others:
            print(f"omni: {flag_name(key)} applies to {', '.join(s.label for s in takers)}; "
                  f"not to {', '.join(others)} (their engines do not take it)", file=sys.stderr, flush=True)
        for s in takers:
            if accepted[s.engine] is None or key in accepted[s.engine]:   # not a neutral no-op
                out.setdefault(str(s.stage_id), {})[key] = value
    return out


def merge_overrides(spread: dict[str, dict], user: dict | None) -> dict[str, dict]:
    """--stage-overrides names a stage explicitly: it wins over a spread flag."""
    out = {k: dict(v) for k, v in spread.items()}
    for k, v in (user or {}).items():
        key = str(k)
        if isinstance(v, dict) and key in out:
            out[key].update(v)
        else:
            out[key] = v
    return out
