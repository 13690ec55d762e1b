"""A deploy's stages checked against the engines they name, at load (config.load: `omni serve`, --dry-run,
a headless stage) rather than in the stage process once the master, the frontends and the other stages
are up: the engine is one the factory knows, the `processor` imports, every engine_args key is one the
engine (or, named and dropped at start, another engine) takes, and a value whose type the engine's
signature states (vLLM's EngineArgs annotations for a vllm stage, read from its source) has that type.

It imports the engine classes (torch), so it is not part of config.validate: a frontend's resolved
config (config.loads_json) was checked here by the head already. The extra engine flags of `omni serve`
are typed by the same annotations (engine_flags.spread_flags: `--seed x`, a bare `--seed`)."""

from __future__ import annotations

import importlib
import json
from typing import TYPE_CHECKING, Any

from omni.errors import ConfigError

if TYPE_CHECKING:
    from omni.config import DeployConfig, StageConfig

_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text", "None": "null"}


def kinds(annotation: str) -> set[str] | None:
    """{"int", "None"} for "int | None"; None: a type this check does not read (list[int], a Literal ...)."""
    parts = {p.strip() for p in annotation.replace("Optional[", "").rstrip("]").split("|")}
    return parts if parts <= set(_KINDS) else None


def wanted(annotation: str) -> str:
    return " or ".join(_KINDS[k] for k in sorted(kinds(annotation) or ()) if k != "None")


def type_ok(value: Any, annotation: str) -> bool:
    """`value` fits `annotation` as far as kinds() reads it (an unread type, or null, always does)."""
    allowed = kinds(annotation)
    if allowed is None or value is None:
        return True
    if isinstance(value, bool):
        return "bool" in allowed
    if isinstance(value, int):
        return bool(allowed & {"int", "float", "str"})
    if isinstance(value, float):
        return bool(allowed & {"float", "str"})
    if isinstance(value, str):
        return "str" in allowed
    return False


def check_engines(config: DeployConfig, source: str) -> DeployConfig:
    for stage in config.stages:
        check_stage(stage, f"{source}: stages[{stage.stage_id}]")
    return config


def check_stage(stage: StageConfig, where: str) -> None:
    from omni.engines import factory

    if stage.engine not in factory.ENGINES:
        raise ConfigError(f"{where}.engine: unknown engine {stage.engine!r} (known: {', '.join(sorted(factory.ENGINES))})")
    if stage.processor:
        check_processor(stage.processor, f"{where}.processor")
    try:
        kept, _ = factory.sort_engine_args(stage)
    except ConfigError as e:
        raise ConfigError(f"{where}.engine_args: {str(e).removeprefix(stage.label + ': ')}") from None
    accepted = factory.accepted_args(stage.engine)
    unknown = sorted(k for k in kept if accepted is not None and k not in accepted)
    if factory.accepted_args("vllm") is None:
        # vLLM's EngineArgs are unknown without vLLM: a key no engine here takes may be vLLM's (vllm-omni's
        # deploys give every stage enable_prefix_caching), so the stage that gets it decides, at its start
        unknown = []
    if unknown:
        raise ConfigError(f"{where}.engine_args.{unknown[0]}: engine {stage.engine} does not take it, nor does any "
                          f"other engine (it takes {', '.join(sorted(accepted or ())) or 'no engine_args'})")
    types = factory.arg_types(stage.engine)
    for key, value in kept.items():
        if key in types and not type_ok(value, types[key]):
            raise ConfigError(f"{where}.engine_args.{key} must be {wanted(types[key])}, got {shown(value)}")


def check_processor(path: str, where: str) -> None:
    """"module:function" as the orchestrator loads it (orchestrator.request_state.load_processor)."""
    module, colon, name = path.partition(":")
    if not colon or not module or not name:
        raise ConfigError(f"{where}: {path!r} is not 'module:function'")
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: {path!r}: module {module!r} cannot be imported ({e})") from None
    if not callable(getattr(found, name, None)):
        raise ConfigError(f"{where}: {path!r}: module {module!r} has no function {name!r}")


def flag_type_refusal(flag: str, value: Any, annotation: str) -> str | None:
    """An extra `omni serve` flag's value checked as the engine's annotation types it; None: it fits."""
    if type_ok(value, annotation):
        return None
    if value is True:       # parse_extra_flags reads a bare flag as true
        return f"{flag} needs a value ({wanted(annotation)})"
    return f"{flag}: expected {wanted(annotation)}, got {shown(value)}"


def shown(value: Any) -> str:
    """As written in YAML / on the command line: true, null, 'x'."""
    return json.dumps(value) if isinstance(value, bool) or value is None else repr(value)
