"""What every route family of the HTTP frontend shares: the orchestrator, the tokenizer and
the model's limits, and the checks built on them (model name, token ids, max_tokens, voices)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import os
import re
import secrets
import struct
import threading
import time
from typing import Any, Sequence

from starlette.requests import Request

from omni import audio
from omni.mm_limits import placeholders_off, too_many_audios
from omni.api.audio_tokens import tower_of
from omni.api.detok import decoder_for
from omni.api.errors import APIError, bad_request
from omni.api.metrics import FrontendMetrics
from omni.api.protocol_media import preset_speed
from omni.api.voices import InMemoryVoiceStore
from omni.config_checks import VOCODERS, talker_refusal, unsampled_refusal
from omni.engines.base import SamplingParams
from omni.errors import NotFound
from omni.orchestrator.types import OrchestratorLike
from omni.sampling import SamplingOverrides
from omni.stage.messages import InlineTensor

# Prompts longer than this (characters) are templated/tokenized on a worker thread so
# the event loop keeps serving other streams. Measured with the SmolLM2 tokenizer: template +
# encode ~0.3 ms at 100 chars, ~3 ms at 2 k, ~56 ms at 20 k; a thread hop costs ~0.13 ms.
OFFLOAD_CHARS = 1024
# vLLM's SamplingParams max_tokens: what a sampling_params_list entry that names none gets (as in vllm-omni).
VLLM_MAX_TOKENS = 16
# The thinker's audio tower takes 16 kHz; longer audio is refused before decoding work piles up.
AUDIO_IN_RATE = 16000
MAX_AUDIO_SECONDS = 600
# All parts of one request together: they ride inline in its AddRequest (4 bytes a sample at 16 kHz, 57.6 MB
# at 900 s), which must stay under the stage channel's message cap with room for the rest of the request
# (orchestrator/limits.MAX_INLINE_BYTES); a small body of 8-bit 1 kHz WAV decodes to 64 times its size.
MAX_AUDIO_TOTAL_SECONDS = 900


def _no_voice(message: str, param: str) -> APIError:
    # 404 like an unknown model: the request is well formed, the voice it names is not there.
    return APIError(404, message, type="not_found_error", param=param, code="voice_not_found")


def no_seed(seed: int | None) -> int | None:
    """vLLM's seed -1 is "no seed" (a fresh random draw), not a generator seeded with -1."""
    return None if seed == -1 else seed


def _background_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)   # this thread only (Linux)
    except (OSError, AttributeError):
        pass


# apply_chat_template's own parameters: never template variables from a client.
RENDER_PARAMS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_variables(tokenizer) -> frozenset[str] | None:
    """The variables the tokenizer's chat template reads (None: not known, any key passes)."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        return None
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError:
        return None


class FrontendState:
    def __init__(self, orchestrator: OrchestratorLike, tokenizer: Any, *, served_model_name: str | Sequence[str],
                 model_aliases, frontend_index: int, max_model_len: int, default_max_tokens: int | None,
                 max_tokens_limit: int | None, speech_entry_stage: int | None, voices,
                 sampling_defaults: SamplingOverrides | None, audio_out: bool | None = None, speakers: tuple[str, ...] = (),
                 default_voice: str | None = None, max_speech_chars: int = 4096, model_path: str | None = None):
        self.orch = orchestrator
        self.tokenizer = tokenizer
        # --served-model-name's names (vLLM's list): each answered to, the first reported.
        self.served_names = ((served_model_name,) if isinstance(served_model_name, str)
                             else tuple(dict.fromkeys(served_model_name)))
        self.model = self.served_names[0]
        self.model_path = model_path or self.model     # /v1/models' `root`, as vLLM's: MODEL as given
        self.names = {*self.served_names, *model_aliases}
        self.frontend_index = frontend_index
        self.max_model_len = max_model_len
        # Audio out: the longest prompt every talker takes (its own KV cache; limits.follow_limits).
        self.audio_prompt_len: int | None = None
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.speech_stage = speech_entry_stage
        self.max_speech_chars = max_speech_chars
        self.job_endpoints: tuple[str, ...] = ()   # the endpoints a job may run here (set by build_app)
        self.images = None     # omni.config.ImageSettings of a pipeline that makes images (set by build_app)
        self.videos = None     # omni.config.VideoSettings of a pipeline that makes videos (set by build_app)
        self.num_stages: int | None = None    # the pipeline's stages: sampling_params_list's most entries
        self.default_modalities: tuple[str, ...] = ("text",)   # a chat naming no modalities (set by build_app)
        self.voices = voices if voices is not None or speech_entry_stage is None else InMemoryVoiceStore()
        # The prompt stage's deploy defaults, under the client's own values (vLLM's generation-config way).
        self.sampling_defaults = sampling_defaults or SamplingOverrides()
        # param -> why this pipeline's prompt stage cannot take it (set by omni/frontend.py)
        self.refused_sampling: dict[str, str] = {}
        # stage id -> {param: why} its engine refuses in a sampling_params_list entry (set by omni/frontend.py)
        self.refused_stage_sampling: dict[int, dict[str, str]] = {}
        self.stage_engines: dict[int, str] = {}    # stage id -> its engine (set by omni/frontend.py)
        # What the live replicas registered (orchestrator/limits.follow_limits): stage id -> what its
        # sampling_params_list entry's stop_token_ids may name; the audio parts a chat may carry (None: the stage checks)
        self.stage_codec_stops: dict[int, set[int]] = {}
        self.audio_limit: int | None = None
        # Audio out through chat: a pipeline with an audio stage (a speech entry implies one).
        self.audio_out = speech_entry_stage is not None if audio_out is None else audio_out
        # The model's own speakers (Qwen3-Omni: chelsie, ethan, aiden), matched in any case;
        # empty: voices come from the voice store (Piper voices and presets).
        self.speakers = tuple(s.lower() for s in speakers)
        if self.speakers:
            self.default_voice = (default_voice or self.speakers[0]).lower()
        else:
            self.default_voice = default_voice or "joe"
        token = getattr(tokenizer, "audio_token", None) if tokenizer is not None else None
        self.audio_token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        # The special tokens that mark where an audio, image or video goes (each part's one placeholder).
        self.placeholders = {k: (t, tokenizer.convert_tokens_to_ids(t)) for k in ("audio", "image", "video")
                             if tokenizer is not None and (t := getattr(tokenizer, f"{k}_token", None))}
        # The thinker's audio tower (the tokenizer's folder is the prompt stage's model): what a part costs.
        self.audio_tower = tower_of(getattr(tokenizer, "name_or_path", None))
        self.metrics = FrontendMetrics(frontend_index, self.model)
        # async () -> the other live frontends' published metrics texts (set by omni/frontend.py)
        self.peer_metrics = None
        # async () -> this frontend's metrics text, once published (set by omni/frontend.py)
        self.publish_metrics = None
        # tokenizer None: a pipeline without a text model (speech only); text routes answer 404.
        self.decode = decoder_for(tokenizer) if tokenizer is not None else (lambda ids: "")
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The batch calls release the GIL while Rust works (`encode` holds it: a 10 MB prompt
        # stalled the event loop for seconds from the worker thread); `_fast` skips offsets.
        batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if batch is not None:
            self.encode = lambda text, special: batch([text], add_special_tokens=special)[0].ids
        elif backend is not None:
            self.encode = lambda text, special: backend.encode(text, add_special_tokens=special).ids
        else:
            self.encode = lambda text, special: tokenizer.encode(text, add_special_tokens=special)
        # No token is longer than this, so a text of more than max_model_len * this many
        # characters cannot fit, and is refused without tokenizing it (vLLM does the same).
        vocab = getattr(tokenizer, "get_vocab", None)
        self.max_chars_per_token = max(map(len, vocab()), default=0) if vocab is not None else 0
        # One thread: HF tokenizers are not safe to use from several threads at once. It runs
        # niced, so on a busy host the event loop (every other request, /health) gets the CPU first.
        self.tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tokenize",
                                                              initializer=_background_priority)
        self.created = int(time.time())
        self.template_vars = template_variables(tokenizer)


    async def offload(self, heavy: bool, fn, *args):
        if not heavy:
            return fn(*args)
        return await asyncio.wrap_future(self.tok_pool.submit(fn, *args))

    def check_prompt_chars(self, chars: int, what: str, param: str) -> None:
        """A prompt of `chars` characters that cannot fit the context whatever its tokens: 400 now."""
        bound = self.max_model_len * self.max_chars_per_token
        if self.max_chars_per_token and chars > bound:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"the {what} contain {chars} characters (more than {bound}, the most that "
                              f"{self.max_model_len} tokens can hold). Reduce the {what}.", param=param)

    def check_audio_prompt(self, n_prompt: int, n_audio: int = 0) -> None:
        """A chat answered with audio: the talker prefills the whole prompt, each audio part expanded to its
        tower's positions (`n_audio` of the `n_prompt`), into its own max_model_len."""
        limit = self.audio_prompt_len
        if limit is not None and n_prompt > limit:
            of = f" ({n_audio} of them for the audio)" if n_audio else ""
            raise bad_request(f"This request asks for audio, and the talker that speaks it takes prompts of at most "
                              f"{limit} tokens (its context, max_model_len, holds the prompt and the speech). However, "
                              f"your messages are {n_prompt} tokens{of}. Reduce the messages, or ask for text only "
                              f'(modalities: ["text"]).', param="messages")

    def check_message_count(self, n: int) -> None:
        """Each message adds at least one template token: more messages than the context are refused
        before anything is templated (a million empty messages take the tokenizer thread ~25 s)."""
        if n > self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"the messages are {n} messages, each at least one token. Reduce the messages.",
                              param="messages")

    def template_kwargs(self, kwargs: dict | None) -> dict:
        """vLLM's chat_template_kwargs, checked: a key the template does not read, or one that is a
        parameter of the rendering itself (tokenize, tools, ...), is refused by name."""
        if not kwargs:
            return {}
        for key in kwargs:
            if key in RENDER_PARAMS or (self.template_vars is not None and key not in self.template_vars):
                why = ("a parameter of the rendering, not a template variable" if key in RENDER_PARAMS else
                       "the chat template does not read it")
                raise bad_request(f"chat_template_kwargs.{key}: {why}", param=f"chat_template_kwargs.{key}")
        return dict(kwargs)

    def render_chat(self, messages: list[dict], kwargs: dict | None = None,
                    ending: tuple[bool, bool] = (True, False), special: bool = False) -> list[int]:
        """`ending`: (add_generation_prompt, continue_final_message), protocol.chat_ending; `special`:
        vLLM's add_special_tokens (BOS etc. on top of what the template writes)."""
        if ending[1]:
            kwargs = {**(kwargs or {}), "continue_final_message": True}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=ending[0], tokenize=False,
                                                      **(kwargs or {}))
        except Exception as e:
            raise bad_request(f"the chat template could not render these messages: {e}",
                              param="messages") from None
        return list(self.encode(text, special))

    def check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{what} {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def need_text(self) -> None:
        if self.tokenizer is None:
            raise APIError(404, "this pipeline has no text model (no tokenizer); only /v1/audio/speech",
                           type="not_found_error")

    def check_model(self, name: str | None) -> None:
        if name and name not in self.names:    # "" is the default model, as in vLLM
            shown = name if len(name) <= 256 else f"{name[:256]}... ({len(name)} characters)"
            raise APIError(404, f"The model `{shown}` does not exist.", param="model",
                           code="model_not_found")

    def max_tokens(self, requested: int | None, n_prompt: int, param: str, what: str, default: int | None = None) -> int:
        room = self.max_model_len - n_prompt
        if requested is None:
            if room < 1:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; "
                                  f"the {what} take {n_prompt} tokens, leaving no room for a completion.",
                                  param=what)
            limit = self.max_tokens_limit or room
            # Neither the request nor the deploy says: the context's room, as vLLM does.
            return max(1, min(default or self.default_max_tokens or room, room, limit))
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

    def sampling(self, req, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """`logprobs`: what P.check_sampling returned for this request."""
        d = self.sampling_defaults
        for name, why in self.refused_sampling.items():
            if getattr(req, name, None):
                raise bad_request(f"{name} is not supported by this pipeline: {why}", param=name)

        def pick(value, default, fallback):
            return value if value is not None else default if default is not None else fallback

        if req.stop_token_ids:    # vLLM's stage refuses them too, but in words naming no field
            self.check_token_ids(req.stop_token_ids, "stop_token_ids entry", "stop_token_ids")
        top_k = pick(req.top_k, d.top_k, 0)
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if vocab is not None and any(t >= vocab for t in bias):
            raise bad_request(f"logit_bias: token id {max(bias)} is outside the vocabulary (size {vocab})",
                              param="logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(req.temperature, d.temperature, 1.0),   # vLLM's default
            top_p=pick(req.top_p, d.top_p, 1.0),
            top_k=0 if top_k < 0 else top_k,
            seed=no_seed(pick(req.seed, d.seed, None)), stop_token_ids=tuple(pick(req.stop_token_ids, d.stop_token_ids, ())),
            ignore_eos=req.ignore_eos or bool(d.ignore_eos),
            presence_penalty=pick(req.presence_penalty, d.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, d.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty, 1.0),
            logit_bias=bias, min_tokens=min(req.min_tokens or d.min_tokens or 0, max_tokens),   # max_tokens ends it first
            logprobs=logprobs)

    def listed_sampling(self, entries: list, sampling: SamplingParams, n_prompt: int
                        ) -> tuple[SamplingParams, dict[int, SamplingOverrides]]:
        """vllm-omni's sampling_params_list: entry 0 is the prompt stage's sampling, in place of the
        request's own fields (vllm-omni's rule; logprobs stay the request's); entry i > 0 is stage i's,
        in place of its deploy defaults. Each entry is whole: what it leaves out is vLLM's default (an
        omitted max_tokens is 16, within the room and the server's limit, which caps every entry)."""
        if self.num_stages is not None and len(entries) > self.num_stages:
            raise bad_request(f"sampling_params_list has {len(entries)} entries; this pipeline has "
                              f"{self.num_stages} stages", param="sampling_params_list")
        stages: dict[int, SamplingOverrides] = {}
        cap = self.max_tokens_limit
        for i, e in enumerate(entries):
            where = f"sampling_params_list[{i}]"
            common = dict(temperature=e.temperature, top_p=e.top_p, top_k=max(e.top_k, 0), seed=no_seed(e.seed),
                          presence_penalty=e.presence_penalty, frequency_penalty=e.frequency_penalty,
                          repetition_penalty=e.repetition_penalty, ignore_eos=e.ignore_eos,
                          stop_token_ids=tuple(e.stop_token_ids))
            if i == 0 and e.stop_token_ids:    # the prompt stage's vocabulary is the tokenizer's
                self.check_token_ids(e.stop_token_ids, "stop_token_ids entry", f"{where}.stop_token_ids")
            if i > 0:
                engine = self.stage_engines.get(i)
                refused = (talker_refusal(self.refused_stage_sampling.get(i, {}), e, self.stage_codec_stops.get(i))
                           or unsampled_refusal(engine, e))
                if refused is not None:
                    name, why = refused
                    raise bad_request(f"{where}.{name}={getattr(e, name)} is not supported by stage {i}"
                                      f"{f' ({engine})' if engine else ''}: {why}", param=f"{where}.{name}")
                # a vocoder ignores max_tokens: vllm-omni's clients send its code2wav 65536
                if cap is not None and e.max_tokens is not None and e.max_tokens > cap and engine not in VOCODERS:
                    raise bad_request(f"{where}.max_tokens={e.max_tokens} is above this server's limit of {cap}",
                                      param=f"{where}.max_tokens")
                mt = e.max_tokens or min(VLLM_MAX_TOKENS, cap or VLLM_MAX_TOKENS)
                if common["seed"] is None:   # no seed (left out or -1): not the request's, which an unset override keeps
                    common["seed"] = secrets.randbits(63)
                stages[i] = SamplingOverrides(max_tokens=mt, min_tokens=e.min_tokens, **common)
                continue
            mt = self.max_tokens(e.max_tokens, n_prompt, f"{where}.max_tokens", "messages", default=VLLM_MAX_TOKENS)
            sampling = SamplingParams(max_tokens=mt, min_tokens=min(e.min_tokens, mt), logprobs=sampling.logprobs,
                                      **common)
        return sampling, stages

    async def voice(self, name: str | None, speed: float = 1.0, param: str = "voice") -> tuple[str, float | None]:
        """Resolve a voice (maybe a preset) to what the speech stage needs: a base voice and speed
        (None: the model's speakers have no speed). `param`: the field that named it, for the 404."""
        if self.speakers:
            key = (name or self.default_voice).lower()
            if key not in self.speakers:
                raise _no_voice(f"voice `{name or self.default_voice}` does not exist; available: "
                                f"{', '.join(self.speakers)}", param)
            return key, None
        name = name or self.default_voice
        if self.voices is None:
            raise _no_voice(f"voice `{name}` does not exist; this pipeline has no voices", param)
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
            raise _no_voice(f"voice `{name}` does not exist; available: {', '.join(known) or 'none'}", param)
        return v["base"], preset_speed(speed, name, float(v.get("speed", 1.0)))

    # ---- audio input (chat `input_audio` parts)

    def need_audio_in(self) -> None:
        if self.audio_token_id is None:
            raise bad_request("audio parts (input_audio, audio_url) are not supported: this model takes no audio input",
                              param="messages")

    def audio_inputs(self, audios: list) -> dict:
        """(param path, InputAudio) pairs -> the thinker's inline inputs `audio_<i>`: float32 mono at
        16 kHz. Runs on the tokenizer thread (decoding and resampling are CPU work)."""
        if self.audio_limit is not None and len(audios) > self.audio_limit:   # before any part is decoded
            part = re.match(r"messages\[\d+\]\.content\[\d+\]", audios[self.audio_limit][0]).group(0)
            raise bad_request(f"{too_many_audios(len(audios), self.audio_limit)}; {part} is the first past it",
                              param=part)
        inputs = {}
        total = 0.0
        for i, (where, ia) in enumerate(audios):
            data = where if where.endswith(".url") else f"{where}.data"     # audio_url: the data URL itself
            if ia.format.lower() != "wav":
                raise bad_request(f"{where}.format `{ia.format}` is not supported (wav)", param=f"{where}.format")
            try:
                raw = base64.b64decode(ia.data, validate=True)
            except (binascii.Error, ValueError):
                raise bad_request(f"{data} is not valid base64", param=data) from None
            try:
                samples, rate = audio.read_wav(raw)
            except (ValueError, struct.error) as e:
                raise bad_request(f"{data} is not decodable audio: {e}", param=data) from None
            if samples.size == 0:
                raise bad_request(f"{data} holds no samples", param=data)
            if samples.size / rate > MAX_AUDIO_SECONDS:
                raise bad_request(f"{where} is {samples.size / rate:.0f} s long; the limit is {MAX_AUDIO_SECONDS} s",
                                  param=data)
            total += samples.size / rate
            if total > MAX_AUDIO_TOTAL_SECONDS:
                raise bad_request(f"the audio parts up to {where} add up to {total:.0f} s; the limit is "
                                  f"{MAX_AUDIO_TOTAL_SECONDS} s a request", param=data)
            pcm = audio.resample(samples, rate, AUDIO_IN_RATE)
            tower = self.audio_tower
            if tower is not None and pcm.size < tower.min_samples:
                raise bad_request(f"{data} is {samples.size / rate * 1000:.1f} ms long; the {tower.name} audio "
                                  f"tower takes at least {tower.min_samples / AUDIO_IN_RATE * 1000:.1f} ms "
                                  f"({tower.min_samples} samples at {AUDIO_IN_RATE} Hz)", param=data)
            inputs[f"audio_{i}"] = InlineTensor("float32", (int(pcm.size),), pcm.astype("<f4").tobytes())
        return inputs

    def audio_positions(self, inputs: dict) -> int:
        """The thinker's prompt positions of the audio inputs once vLLM expands them (one a part without a
        known tower: its placeholder)."""
        tower = self.audio_tower
        return sum(tower.positions(t.shape[0]) if tower else 1 for t in inputs.values())

    def check_placeholders(self, prompt_ids: list[int], n_audio: int, param: str = "messages") -> None:
        """One placeholder per audio part, none for images and video (chat takes none): a placeholder typed
        in the text (`param`: messages, or a completion's prompt) would otherwise fail in the thinker."""
        for kind, (token, tid) in self.placeholders.items():
            found, want = prompt_ids.count(tid), n_audio if kind == "audio" else 0
            off = placeholders_off(kind, found, want, f"`{token}`")
            if found > want:
                none = "" if kind == "audio" else f" (this server takes no {kind} parts)"
                raise bad_request(f"{off}{none}: `{token}` typed in the {param} is the special token that marks where "
                                  f"{'an' if kind != 'video' else 'a'} {kind} goes; remove it from the text", param=param)
            if found < want:
                raise bad_request(f"{off}: the chat template placed too few", param="messages")

    def t0(self, request: Request) -> float:
        return request.scope.get("omni.t0", time.monotonic())

    # ---- text routes

    def need_speech(self) -> None:
        if self.speech_stage is None and self.audio_out:
            raise bad_request("/v1/audio/speech is not available for this pipeline: its talker speaks the "
                              "thinker's answer and has no text-to-speech entry; use /v1/chat/completions with "
                              '"modalities": ["text", "audio"]', param="input")
        if self.speech_stage is None:
            raise APIError(404, "this pipeline has no speech output (no talker stage)", type="not_found_error")

