"""What every route family of the HTTP frontend shares: the orchestrator, the tokenizer and
the model's limits, and the checks built on them (model name, token ids, max_tokens, voices)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from starlette.requests import Request

from omni.api.detok import decoder_for
from omni.api.errors import APIError, bad_request
from omni.api.metrics import FrontendMetrics
from omni.api.voices import InMemoryVoiceStore
from omni.engines.base import SamplingParams
from omni.errors import NotFound
from omni.orchestrator.types import OrchestratorLike

# Prompts longer than this (characters) are templated/tokenized on a worker thread so
# the event loop keeps serving other streams. Measured with the SmolLM2 tokenizer: template +
# encode ~0.3 ms at 100 chars, ~3 ms at 2 k, ~56 ms at 20 k; a thread hop costs ~0.13 ms.
OFFLOAD_CHARS = 1024


class FrontendState:
    def __init__(self, orchestrator: OrchestratorLike, tokenizer: Any, *, served_model_name: str,
                 model_aliases, frontend_index: int, max_model_len: int, default_max_tokens: int,
                 max_tokens_limit: int | None, speech_entry_stage: int | None, voices,
                 default_temperature: float):
        self.orch = orchestrator
        self.tokenizer = tokenizer
        self.model = served_model_name
        self.names = {served_model_name, *model_aliases}
        self.frontend_index = frontend_index
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.speech_stage = speech_entry_stage
        self.voices = voices if voices is not None or speech_entry_stage is None else InMemoryVoiceStore()
        self.default_temperature = default_temperature
        self.metrics = FrontendMetrics(frontend_index, served_model_name)
        # async () -> the other live frontends' published metrics texts (set by omni/frontend.py)
        self.peer_metrics = None
        # tokenizer None: a pipeline without a text model (speech only); text routes answer 404.
        self.decode = decoder_for(tokenizer) if tokenizer is not None else (lambda ids: "")
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self.encode = lambda text, special: backend.encode(text, add_special_tokens=special).ids
        else:
            self.encode = lambda text, special: tokenizer.encode(text, add_special_tokens=special)
        # One thread: HF tokenizers are not safe to use from several threads at once.
        self.tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tokenize")
        self.created = int(time.time())


    async def offload(self, heavy: bool, fn, *args):
        if not heavy:
            return fn(*args)
        return await asyncio.wrap_future(self.tok_pool.submit(fn, *args))

    def render_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise bad_request(f"the chat template could not render these messages: {e}",
                              param="messages") from None
        return list(self.encode(text, False))

    def check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{what} {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def need_text(self) -> None:
        if self.tokenizer is None:
            raise APIError(404, "this pipeline has no text model (no tokenizer); only /v1/audio/speech",
                           type="not_found_error")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def max_tokens(self, requested: int | None, n_prompt: int, param: str, what: str) -> int:
        room = self.max_model_len - n_prompt
        if requested is None:
            if room < 1:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; "
                                  f"the {what} take {n_prompt} tokens, leaving no room for a completion.",
                                  param=what)
            limit = self.max_tokens_limit or room
            return max(1, min(self.default_max_tokens, room, limit))
        if requested < 1:
            raise bad_request(f"{param}={requested} must be at least 1", param=param)
        if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
            raise bad_request(f"{param}={requested} is above this server's limit of "
                              f"{self.max_tokens_limit}", param=param)
        if n_prompt + requested > self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {n_prompt + requested} tokens ({n_prompt} in the {what}, "
                              f"{requested} in the completion). Reduce the {what} or {param}.", param=param)
        return requested

    def sampling(self, req, max_tokens: int) -> SamplingParams:
        top_k = req.top_k or 0
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if vocab is not None and any(t >= vocab for t in bias):
            raise bad_request(f"logit_bias: token id {max(bias)} is outside the vocabulary (size {vocab})",
                              param="logit_bias")
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}", param="min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias, min_tokens=req.min_tokens)

    async def voice(self, name: str | None, speed: float = 1.0) -> dict:
        """Resolve a voice (maybe a preset) to what the speech stage needs: a base voice and speed."""
        name = name or "joe"
        if self.voices is None:
            raise bad_request(f"voice `{name}` does not exist; this pipeline has no voices", param="voice")
        get = getattr(self.voices, "get", None)
        v = None
        if get is not None:  # the master-backed store looks one name up without listing all
            try:
                v = await get(name)
            except NotFound:
                v = None
        else:
            v = next((x for x in await self.voices.list() if x["name"] == name), None)
        if v is None:
            known = [x["name"] for x in await self.voices.list()]
            raise bad_request(f"voice `{name}` does not exist; available: {', '.join(known) or 'none'}",
                              param="voice")
        return {"voice": v["base"], "speed": speed * float(v.get("speed", 1.0)), "voice_name": name}

    def t0(self, request: Request) -> float:
        return request.scope.get("omni.t0", time.monotonic())

    # ---- text routes

    def need_speech(self) -> None:
        if self.speech_stage is None:
            raise APIError(404, "this pipeline has no speech output (no talker stage)", type="not_found_error")

