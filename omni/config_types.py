"""The deploy config's types: the typed, frozen tree that omni/config.py resolves a deploy YAML into and
validates, and the hash that names it. Apart from config.py, which finds, merges and checks the YAML, so
what every process reads of a config (stages, pipeline settings) stands on its own; config.py re-exports
these names, as most callers import them from there."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from omni.errors import ConfigError
from omni.media_settings import ImageSettings, VideoSettings
from omni.sampling import SamplingOverrides


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    transport: str = "auto"
    arena_bytes: int | None = None


class StageConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    stage_id: int
    engine: str
    name: str = ""
    model: str | None = None            # defaults to the pipeline's model
    devices: str = "cpu"
    env: dict[str, str] = {}            # the stage process's environment variables (config_stage_checks)
    num_replicas: int = 1
    engine_args: dict[str, Any] = {}
    # The stage's own sampling; a key it does not know is refused by name (omni.sampling).
    default_sampling_params: SamplingOverrides = SamplingOverrides()
    # "prompt" (the request's token ids), "text" (the request's text) or an upstream stage id.
    inputs: tuple[str | int, ...] = ("prompt",)
    # "module:function" turning upstream outputs into this stage's inputs.
    processor: str | None = None
    final_output: bool = False
    final_output_type: str | None = None
    # Outgoing edges: downstream stage id (as a string) -> connector.
    connectors: dict[str, ConnectorConfig] = {}
    # > 0: after a request's first output this stage holds the request's next work (at most this
    # many ms) until the pipeline's first final output of it is out: on a few shared cores a
    # talker's next sentence would split the CPU with code2wav's first chunk. 0: off.
    first_output_hold_ms: float = 0.0

    @property
    def label(self) -> str:
        return f"stage {self.stage_id}" + (f" ({self.name})" if self.name else "")

    def upstream(self) -> list[int]:
        return [i for i in self.inputs if isinstance(i, int)]


STAGE_FIELDS = set(StageConfig.__struct_fields__)


class PipelineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = "pipeline"
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    lease_ttl_s: float = 5.0
    # How long a stage's output may wait for consumers to free tensors or read results
    # (backpressure) before the request at the head of the wait fails.
    stall_timeout_s: float = 60.0
    # A stage whose loop has work and gets nowhere this long stops heartbeating (omni/stage/loop_watch.py):
    # longer than any one engine step (a long prefill or a denoise step on CPU); 0: never.
    loop_stall_s: float = 120.0
    # Stage that /v1/audio/speech enters at (None: the pipeline has no speech).
    speech_entry_stage: int | None = None
    # The model's own speakers (chat `audio.voice`, any case); empty: the voice store's voices.
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    # The most max_tokens (max_completion_tokens) one request may ask for; None: the context.
    max_tokens_limit: int | None = None
    # The longest /v1/audio/speech input, in characters (at most 4096).
    max_speech_chars: int = 4096
    # What a chat that names no `modalities` gets: OpenAI's ("text"), or vllm-omni's every output.
    default_modalities: tuple[str, ...] = ("text",)
    images: ImageSettings = ImageSettings()
    videos: VideoSettings = VideoSettings()


class DeployConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str
    stages: tuple[StageConfig, ...]
    aliases: tuple[str, ...] = ()
    pipeline: PipelineSettings = PipelineSettings()
    base_config: str | None = None      # resolved away; kept for the record

    def stage(self, stage_id: int) -> StageConfig:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise ConfigError(f"--stage-id {stage_id}: the pipeline has stages 0..{len(self.stages) - 1}")

    def to_dict(self) -> dict[str, Any]:
        # Through JSON so tuples become lists: the same shape a child reads back.
        return json.loads(msgspec.json.encode(self))

    def config_hash(self) -> str:
        return config_hash(self.to_dict())

    def final_stage(self, modality: str) -> StageConfig | None:
        for s in self.stages:
            if s.final_output and s.final_output_type == modality:
                return s
        return None

    def modalities(self) -> list[str]:
        return [s.final_output_type for s in self.stages if s.final_output and s.final_output_type]

    def downstream(self, stage_id: int) -> list[int]:
        return [s.stage_id for s in self.stages if stage_id in s.upstream()]


def prompt_stage(config: Any) -> StageConfig | None:
    """The entry stage: the first that takes the rendered chat (inputs: [prompt])."""
    return next((s for s in config.stages if "prompt" in s.inputs), None)


def config_hash(data: dict[str, Any]) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
