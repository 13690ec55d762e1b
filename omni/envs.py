"""Every environment variable omni reads, in one place (the model is vLLM's envs.py).

Read lazily as attributes, so a value set after import (a test, a parent process) counts:
`from omni import envs; envs.OMNI_CACHE_DIR`. The CLI reads some of the same variables as
fallbacks for its flags: OMNI_TOKEN, OMNI_CONTROL_API_KEY (typer's `envvar=`), OMNI_API_KEY
(omni/cli.py's _api_keys, one key, as vLLM reads VLLM_API_KEY).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from omni.errors import ConfigError

environment_variables: dict[str, Callable[[], Any]] = {
    # Shared secret of the master and the data plane; children get it by environment, never argv.
    "OMNI_TOKEN": lambda: os.environ.get("OMNI_TOKEN", ""),
    # Bearer key the /v1 routes require (--api-key); one key, as vLLM reads VLLM_API_KEY.
    "OMNI_API_KEY": lambda: os.environ.get("OMNI_API_KEY") or None,
    # The keys a frontend accepts (any one), a JSON list of strings: the launcher sets it for its
    # frontends from --api-key's values; unset, OMNI_API_KEY's one key (or none).
    "OMNI_API_KEYS": lambda: _api_keys(os.environ.get("OMNI_API_KEYS")),
    # Bearer key of the control routes (--control-api-key); the launcher hands it to frontends.
    "OMNI_CONTROL_API_KEY": lambda: os.environ.get("OMNI_CONTROL_API_KEY") or None,
    # "off": the control routes answer 403 (--disable-control-routes, set by the launcher).
    "OMNI_CONTROL_ROUTES": lambda: os.environ.get("OMNI_CONTROL_ROUTES", "on") != "off",
    # Where converted models and extracted voices are cached.
    "OMNI_CACHE_DIR": lambda: os.path.expanduser(os.environ.get("OMNI_CACHE_DIR") or "~/.cache/omni"),
    # Where `omni serve` notes its master's address for `omni status` (default: $XDG_RUNTIME_DIR/omni
    # or /tmp/omni-UID).
    "OMNI_RUN_DIR": lambda: os.environ.get("OMNI_RUN_DIR") or None,
    # The frontends' event loop: "uvloop" (the default, when installed) or "asyncio".
    "OMNI_EVENT_LOOP": lambda: os.environ.get("OMNI_EVENT_LOOP", "uvloop"),
    # A directory: stages and frontends write per-token timestamps and GC pauses there
    # (omni/latency_trace.py); unset, nothing is traced.
    "OMNI_LATENCY_TRACE": lambda: os.environ.get("OMNI_LATENCY_TRACE") or None,
    # The stage channel between a frontend and a stage replica on one host: "local" (the default: a
    # unix SEQPACKET LocalChannel where both ends can reach it, ZMQ+CURVE otherwise) or "zmq" (always
    # ZMQ; for benchmarks and debugging). Either end set to "zmq" keeps that pair on ZMQ.
    "OMNI_STAGE_CHANNEL": lambda: os.environ.get("OMNI_STAGE_CHANNEL", "local").strip().lower() or "local",
    # Microseconds a stage loop (and a blocking LocalChannel.recv) polls without blocking before it
    # sleeps: a message landing meanwhile skips the wake-up of a halted vCPU. 0 turns it off.
    "OMNI_SPIN_US": lambda: _spin_us(os.environ.get("OMNI_SPIN_US", "50")),
    # The id a launcher's child registers under with the master (a uuid4's hex, new at each start), so the
    # launcher marks the entries of a child it reaped by it, not by host and pid; unset, a random one.
    "OMNI_INSTANCE_ID": lambda: _instance_id(os.environ.get("OMNI_INSTANCE_ID")),
    # The deploy's `platforms.<name>` section to apply, "cpu" or "cuda" (any case); unset: "cuda" where an
    # NVIDIA GPU is visible (omni/config.py current_platform).
    "OMNI_PLATFORM": lambda: _platform(os.environ.get("OMNI_PLATFORM", "")),
}

PLATFORMS = ("cpu", "cuda")


def _api_keys(value: str | None) -> list[str]:
    if value is None:
        key = os.environ.get("OMNI_API_KEY")
        return [key] if key else []
    try:
        keys = json.loads(value)
    except json.JSONDecodeError:
        keys = None
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        # never echo the value: it holds keys
        raise ConfigError("OMNI_API_KEYS: expected a JSON list of non-empty strings (the API keys)")
    return keys


def _instance_id(value: str | None) -> str | None:
    if not value:
        return None
    if re.fullmatch(r"[0-9a-f]{32}", value) is None:
        raise ConfigError(f"OMNI_INSTANCE_ID={value[:40]!r}: expected 32 lowercase hex digits (a uuid4's hex, "
                          "as the launcher sets it)")
    return value


def _platform(value: str) -> str | None:
    # another name picked no section at all: the GPU values on a CPU host, silently
    platform = value.strip().lower()
    if platform and platform not in PLATFORMS:
        raise ConfigError(f"OMNI_PLATFORM={value[:40]!r}: expected {' or '.join(PLATFORMS)} (the deploy's "
                          "platforms.<name> section to apply), or unset to detect it")
    return platform or None


def _spin_us(value: str) -> int:
    try:
        us = int(value)
    except ValueError:
        us = -1
    if not 0 <= us <= 10_000:
        raise ConfigError(f"OMNI_SPIN_US={value!r}: expected whole microseconds from 0 to 10000")
    return us


def default_vllm_log_level(level: str) -> None:
    """vLLM logs at INFO unless VLLM_LOGGING_LEVEL says otherwise, read when it first configures logging in a
    process: omni's --log-level is that default for every process of this command and its children (stages,
    their EngineCore), who inherit the environment; a value the user set wins."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
