"""The engine interface every stage engine implements.

An engine is a pure, socket-free core: the stage worker feeds it requests and
calls `step()` in its loop; `step()` does one unit of batched work and returns
whatever outputs that work produced. Tensors in requests/outputs are plain
torch tensors here; the stage worker moves them over the transport.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable

import msgspec
import torch

from omni.engines.logprobs import Logprobs
from omni.sampling import SamplingOverrides, SamplingParams

__all__ = ["Engine", "EngineError", "EngineOutput", "EngineRequest", "ImageParams", "SamplingOverrides",
           "SamplingParams", "StageFacts", "StreamEngine", "facts_of"]


class ImageParams(msgspec.Struct, frozen=True, kw_only=True):
    """What an image (or video) request asks of a diffusion stage (its prompt is the request's text or token ids).
    The frontend fills every field (deploy defaults under the client's values) and bounds them."""
    width: int
    height: int
    num_inference_steps: int
    # Classifier-free guidance scale (Qwen-Image: diffusers' `true_cfg_scale`); <= 1: no guidance.
    guidance_scale: float
    negative_prompt: str | None = None   # the unconditional prompt of the guidance
    n: int = 1                           # images of this prompt, drawn from one generator
    seed: int = 0
    num_frames: int = 1                  # a video's frames (a video stage's; an image is one frame)


class StageFacts(msgspec.Struct, kw_only=True):
    """What a stage is told of a request besides its input; the stage channel's AddRequest
    carries the same fields (omni.stage.messages), so they cross processes typed."""
    # False: a piece of a continuing request (same request_id) and more pieces follow.
    final: bool = True
    # The voice (speaker) to speak in and its speed; None: the engine's default.
    voice: str | None = None
    speed: float | None = None
    # Token ids the upstream stage generated in this piece (a talker reads its thinker's
    # prompt from prompt_token_ids and the generated text from here).
    generated_ids: list[int] | None = None
    # The request's output will be spoken: a thinker captures what its talker needs.
    audio_out: bool = False
    # Whether the first output carries the prompt as the engine expanded it; None: the engine's default.
    emit_prompt_ids: bool | None = None
    # This stage's own sampling over the request's (deploy default_sampling_params).
    overrides: SamplingOverrides = SamplingOverrides()
    # An image request: size, steps, guidance, seed (a diffusion stage's input besides its prompt).
    image: ImageParams | None = None


def facts_of(obj: StageFacts) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in StageFacts.__struct_fields__}


class EngineRequest(StageFacts, kw_only=True):
    request_id: str
    prompt_token_ids: list[int] | None = None
    text: str | None = None
    sampling: SamplingParams = SamplingParams()
    # Named tensors from the previous stage (e.g. "hidden_states", "latents").
    tensors: dict[str, Any] = {}

    def effective_sampling(self) -> SamplingParams:
        return self.overrides.over(self.sampling)


class EngineOutput(msgspec.Struct, kw_only=True):
    request_id: str
    # Delta since the previous output of this request.
    token_ids: list[int] = []
    text: str | None = None
    tensors: dict[str, Any] = {}
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # Number of prompt tokens (set on the first output of a request).
    num_prompt_tokens: int | None = None
    sample_rate: int = 0               # Hz of an "audio" tensor (audio outputs only)
    logprobs: Logprobs | None = None   # one row per token id, when the request asked for them
    # vLLM's stop_reason: the token id a "stop" finish stopped on (a stop_token_ids entry or an EOS id;
    # the frontend nulls the tokenizer's EOS as vLLM's server does), None for length
    stop_reason: int | str | None = None


class EngineError(Exception):
    """A request-level failure: reported as that request's error, the engine lives."""


class Engine(abc.ABC):
    """One stage engine. Not thread-safe: the stage worker owns it."""

    # Set by the stage worker (its LoopWatch): an engine whose one step can run for minutes (a CPU encoder
    # pass, a denoising step) calls `progressed()` as it gets somewhere, so pipeline.loop_stall_s takes a
    # long step that moves for what it is and only one that is stuck for a hang.
    progress_hook: Callable[[], None] | None = None

    def progressed(self) -> None:
        if self.progress_hook is not None:
            self.progress_hook()

    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raise EngineError for a bad request."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request; unknown ids are ignored."""

    @abc.abstractmethod
    def step(self) -> list[EngineOutput]:
        """Do one unit of batched work and return the outputs it produced."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""

    def ready_fd(self) -> int | None:
        """A file descriptor that turns readable when step() has outputs to hand out (an
        engine whose work runs elsewhere, e.g. vLLM's EngineCore). The worker then sleeps
        on it with its sockets instead of calling step() in a loop; it still calls step()
        every STEP_IDLE_S while work is in flight, so step() can report a dead engine.
        None: the worker calls step() whenever the engine has unfinished work."""
        return None

    def can_hold(self) -> bool:
        """True when hold()/release() work (a stage's `first_output_hold_ms` needs it)."""
        return False

    def hold(self, request_id: str, until: float) -> None:
        """Step no more of this request before `until` (time.monotonic()) unless released: its
        next work would share the CPU with a later stage making the request's first output."""

    def release(self, request_id: str) -> None:
        """End a hold early; unknown or unheld ids are ignored."""

    def held_until(self) -> float | None:
        """The earliest end of a hold (the worker wakes then), None with nothing held."""
        return None

    def num_waiting(self) -> int:
        return 0

    def num_running(self) -> int:
        return 0

    def sleep(self, level: int = 1) -> None:
        raise EngineError(f"{type(self).__name__} cannot sleep on this platform")

    def wake_up(self) -> None:
        """Wakes a sleeping engine; one awake (always, for one that cannot sleep) is left as it is: a wakeup
        of every replica after some were put to sleep must not fail on the others."""

    def is_sleeping(self) -> bool:
        return False

    def can_sleep(self) -> bool:
        return False

    def can_sleep_at(self, level: int) -> bool:
        """Whether sleep(level) can succeed with no work open: a sleep with mode=abort ends the requests only then."""
        return self.can_sleep()

    def stats(self) -> dict[str, float]:
        return {}

    def load_extra(self) -> dict[str, float]:
        """Gauges for the stage's load report (`omni status`, the frontends' /metrics as
        omni_stage_engine_<name>). Read from the keep-alive thread: return a dict the loop
        thread replaced whole after its last step, never one it changes in place."""
        return {}

    def shutdown(self) -> None:
        pass


class StreamEngine(Engine):
    """An engine whose requests stay open between pieces (a talker waiting for its thinker's next
    tokens, a vocoder for its next codes): only the ready ones count as unfinished, else the stage
    loop would spin on streams that wait; the waiting ones show in num_waiting()."""

    @abc.abstractmethod
    def open_requests(self) -> Iterable[Any]:
        """The open requests (streams), finished or not."""

    @abc.abstractmethod
    def is_ready(self, r: Any) -> bool:
        """True when a step can advance r."""

    def has_unfinished(self) -> bool:
        return any(self.is_ready(r) for r in self.open_requests())

    def has_open_streams(self) -> bool:
        return any(True for _ in self.open_requests())

    def num_waiting(self) -> int:
        return sum(1 for r in self.open_requests() if not self.is_ready(r))

    def num_running(self) -> int:
        return sum(1 for r in self.open_requests() if self.is_ready(r))


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
