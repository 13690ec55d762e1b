"""Wire types of the stage channel (frontend <-> stage replica), msgpack via msgspec.

One typed decoder per direction; dispatch by tag. New fields go last, with defaults.
Tensors never ride here: only TensorRef descriptors.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

from omni.engines.base import EngineOutput, StageFacts
from omni.engines.logprobs import Logprobs
from omni.sampling import SamplingParams
from omni.transport.base import TensorRef


# ------------------------------------------------------------- frontend -> stage

class Hello(msgspec.Struct, frozen=True, tag="hello"):
    frontend_id: str
    token: str = ""
    host: str = "127.0.0.1"


class InlineTensor(msgspec.Struct, frozen=True):
    """A client's input tensor (audio in a chat message) carried in the request itself: it comes
    from the HTTP body, not from a stage, so no producer holds it. Bounded by the frontend's caps."""
    dtype: str                       # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    data: bytes


class AddRequest(StageFacts, frozen=True, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int] | None = None
    text: str | None = None
    sampling: SamplingParams = SamplingParams()
    tensors: dict[str, TensorRef] = {}
    # and the StageFacts fields: what the engine is told besides its input.
    # Transport for this request's output tensors (chosen by the orchestrator
    # from where the consumer runs); "" means the stage default.
    out_transport: str = ""
    sent_at: float = 0.0
    # False: nobody will read this request's output tensors; do not publish them.
    out_tensors: bool = True
    # Client inputs carried inline (name -> tensor), e.g. "audio_0"; the engine sees them in `tensors`.
    inline: dict[str, InlineTensor] = {}
    # > 0: after its first output the engine holds this request that long at most, or until a
    # Release (the stage's `first_output_hold_ms`: the pipeline's first audio is on its way).
    hold_ms: float = 0.0
    # The consuming stage's `devices` when `transport: auto` picked shm for this edge (one host):
    # a CUDA output tensor takes cuda_ipc instead if that stage sees its GPU. "" otherwise.
    out_devices: str = ""


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]
    # True: stop the requests only; the tensors they published stay until a FreeTensors (a later
    # stage still reads them: a stop string ended the text, the audio goes on). False: freed too.
    keep_published: bool = False


class Release(msgspec.Struct, frozen=True, tag="release"):
    """The pipeline's first final output of these requests is out: step them again."""
    request_ids: list[str]


class FreeTensors(msgspec.Struct, frozen=True, tag="free"):
    keys: list[int]
    transport: str = "shm"
    incarnation: str = ""            # the refs' producer: another one (a restart under the same id) ignores it


class Utility(msgspec.Struct, frozen=True, tag="utility"):
    call_id: int
    method: str                      # "sleep" | "wake_up" | "is_sleeping" | "stats" | "ping"
    args: dict[str, Any] = {}


ToStage = Union[Hello, AddRequest, Abort, FreeTensors, Utility, Release]


# ------------------------------------------------------------- stage -> frontend

class Output(msgspec.Struct, frozen=True, tag="out", kw_only=True):
    request_id: str
    token_ids: list[int] = []
    text: str | None = None
    tensors: dict[str, TensorRef] = {}
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    # Seconds the request waited in the stage before its first step (on the first output).
    queue_s: float | None = None
    step_s: float = 0.0
    sent_at: float = 0.0                 # wall clock when the stage sent it (output queue delay)
    sample_rate: int = 0                 # Hz of the audio tensor in `tensors` (audio outputs only)
    logprobs: Logprobs | None = None     # per token id of `token_ids`, when the request asked for them
    stop_reason: int | str | None = None  # the stop token id that finished it (vLLM's stop_reason)


def output_of(out: EngineOutput, refs: dict[str, TensorRef], queue_s: float | None, step_s: float) -> Output:
    """The message of an engine output whose tensors went out as `refs`."""
    return Output(request_id=out.request_id, token_ids=out.token_ids, text=out.text, tensors=refs,
                  finished=out.finished, finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                  queue_s=queue_s, step_s=step_s, sent_at=time.time(), sample_rate=out.sample_rate,
                  logprobs=out.logprobs, stop_reason=out.stop_reason)


class RequestError(msgspec.Struct, frozen=True, tag="err"):
    request_id: str
    message: str
    stage_id: int = -1
    replica_id: str = ""
    kind: str = "internal"               # omni.errors kinds: client | unavailable | timeout | internal


class UtilityResult(msgspec.Struct, frozen=True, tag="ures"):
    call_id: int
    ok: bool
    result: Any = None
    error: str = ""


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    stage_id: int
    replica_id: str
    ok: bool = True
    error: str = ""


FromStage = Union[Output, RequestError, UtilityResult, Welcome]


class Codec:
    """Encoder + the typed decoder for one direction."""

    def __init__(self, incoming: Any):
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(incoming)

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._dec.decode(data)


def stage_codec() -> Codec:
    return Codec(ToStage)


def frontend_codec() -> Codec:
    return Codec(FromStage)


def inline_tensor(t: InlineTensor) -> Any:
    """The torch tensor an InlineTensor carries (a copy: the message buffer is not kept)."""
    import math

    import torch

    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"inline tensor dtype {t.dtype!r} is not a torch dtype")
    n = math.prod(t.shape)
    if n * dtype.itemsize != len(t.data):
        raise ValueError(f"inline tensor of shape {list(t.shape)} {t.dtype} needs {n * dtype.itemsize} bytes, "
                         f"got {len(t.data)}")
    if n == 0:
        return torch.empty(t.shape, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(t.shape)
