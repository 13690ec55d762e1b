"""What the HTTP frontend hands the orchestrator, and what it gets back."""

from __future__ import annotations

from typing import AsyncIterator, Protocol

import msgspec

from omni.engines.base import ImageParams, SamplingOverrides, SamplingParams
from omni.engines.logprobs import Logprobs
from omni.stage.messages import InlineTensor


class PipelineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    # Thinker input, tokenized in the frontend (chat template applied there).
    prompt_token_ids: list[int] | None = None
    # Text input for pipelines that start past the thinker (/v1/audio/speech).
    text: str | None = None
    sampling: SamplingParams = SamplingParams()
    # A later stage's sampling from the request (vllm-omni's sampling_params_list), instead of its deploy's.
    stage_overrides: dict[int, SamplingOverrides] = {}
    # Which outputs the client wants; the pipeline stops at the last stage needed.
    modalities: tuple[str, ...] = ("text",)
    # Stage the request enters at (0 for chat; the talker for speech).
    entry_stage: int = 0
    # The voice to speak in (a base voice of the speech stage) and its speed; None: the default.
    voice: str | None = None
    speed: float | None = None
    # The answer will be spoken: the thinker captures what its talker needs.
    audio_out: bool = False
    num_audio_inputs: int = 0          # audio parts in the prompt (the thinker emits their hidden rows)
    timeout_s: float | None = None
    # Client input tensors for the entry stage (e.g. "audio_0": 16 kHz float32), carried inline.
    inputs: dict[str, InlineTensor] = {}
    # /v1/images/generations: what the diffusion stage makes of the prompt (`text`).
    image: ImageParams | None = None
    # The prompt's length as the entry stage's vLLM counts it (each audio placeholder expanded to its tower's
    # positions): what routing checks against a replica's max_model_len. None: len(prompt_token_ids).
    prompt_positions: int | None = None


class PipelineOutput(msgspec.Struct, kw_only=True):
    request_id: str
    stage_id: int
    modality: str                      # "text" | "audio" | "embedding" | "image" | "video"
    token_ids: list[int] = []          # text delta (token ids; the frontend detokenizes)
    audio_pcm: bytes = b""             # audio delta: little-endian float32 mono PCM
    sample_rate: int = 0
    finished: bool = False             # True on the last output of the whole request
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    embedding: list[float] | None = None   # modality "embedding"
    logprobs: Logprobs | None = None   # modality "text": one row per token id, when asked for
    # On the finishing output, and on the text stage's last one: the stop token id that ended it.
    stop_reason: int | str | None = None
    # modality "image": uint8 RGB rows of `image_shape` [n, height, width, 3]; "video": [n, frames, height, width, 3].
    # Bytes-like: a read tensor's is a memoryview of the frontend's copy (fetch.host_bytes: no GIL-held copy to bytes)
    image: bytes = b""
    image_shape: tuple[int, ...] = ()
    # modality "image" of a stage fed by another: the prompt it rendered (what the upstream stage wrote)
    prompt: str | None = None


class OrchestratorLike(Protocol):
    """The surface the HTTP app uses (a fake implements it in unit tests)."""

    def generate(self, request: PipelineRequest) -> AsyncIterator[PipelineOutput]:
        """Stream outputs; raises omni.errors.OmniError subclasses. Closing the
        iterator early (client gone) aborts the request in every stage."""

    def end_text(self, request_id: str) -> None:
        """A stop string ended the text of a request with audio: the text stage ends there and the
        stages after it speak what it sent (the stream goes on to the request's end)."""

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok is False when a required stage has no READY replica."""

    async def sleep(self, level: int = 1, mode: str = "abort", stage_ids: tuple[int, ...] = ()) -> dict: ...

    async def wake_up(self, stage_ids: tuple[int, ...] = ()) -> dict: ...

    async def is_sleeping(self) -> bool: ...

    def metrics_text(self) -> str:
        """Prometheus exposition of the orchestrator's metrics."""
