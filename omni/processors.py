"""Stage processors: plain functions named in deploy YAMLs (`processor:`).

`fn(ctx, state, out) -> list[StageInput]` turns one upstream output into inputs
for the next stage. `state` is a per-request dict the function may keep things in;
`ctx.detokenize(ids)` is the frontend's tokenizer. Tensor refs pass through as
descriptors: the bytes go producer -> consumer, never through here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from omni.engines.base import ImageParams
from omni.orchestrator.types import PipelineRequest
from omni.stage.messages import Output
from omni.transport.base import TensorRef


@dataclass
class StageInput:
    text: str | None = None
    token_ids: list[int] | None = None
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    # What the next stage is told besides its input (omni.engines.base.EngineRequest has the meaning).
    voice: str | None = None
    speed: float | None = None
    generated_ids: list[int] | None = None
    audio_out: bool = False
    emit_prompt_ids: bool | None = None
    # Set: an independent sub-request (e.g. one sentence); None: a piece of one
    # continuing request, the last of which the orchestrator marks final.
    sub_id: str | None = None
    # A piece the next stage can take at once (not held back to be marked final);
    # the orchestrator then closes the request with an empty piece marked final.
    stream: bool = False
    # Client input tensors carried in the request itself (entry stage: audio in a chat message).
    inline: dict[str, Any] = field(default_factory=dict)
    # An image request's size, steps, guidance and seed (a diffusion stage; an upstream stage that
    # writes its prompt passes the client's on: ctx.request.image).
    image: ImageParams | None = None


class Context(Protocol):
    request: PipelineRequest       # voice, speed, num_audio_inputs: what the client asked

    def detokenize(self, token_ids: list[int]) -> str: ...


def passthrough(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    if not out.token_ids and not out.tensors:
        return []
    return [StageInput(token_ids=list(out.token_ids), tensors=dict(out.tensors))]


def first_talker_piece(ctx: Context, tensors: dict, ids: list[int], default_voice: str) -> StageInput:
    """A talker's first piece: the prompt (the thinker's expanded `prompt_token_ids` tensor in
    `tensors`, else the request's own ids), the voice and the first generated ids."""
    prompt = None if "prompt_token_ids" in tensors else ctx.request.prompt_token_ids
    return StageInput(token_ids=list(prompt) if prompt is not None else None, tensors=tensors,
                      voice=ctx.request.voice or default_voice, generated_ids=ids, stream=True)



def hidden_states_to_pooler(ctx: Context, state: dict, out: Output) -> list[StageInput]:
    ref = out.tensors.get("hidden_states")
    return [StageInput(tensors={"hidden_states": ref})] if ref is not None else []
