"""Request bodies of the OpenAI-compatible routes, decoded with msgspec, and their checks.

Unknown fields are ignored (OpenAI clients send extras); wrong types, missing required fields
and values out of range become a 400 naming the parameter. The constraints sit on the types
(msgspec `Meta`), so openapi.json (omni/api/openapi.py), generated from these types, states what
decoding enforces. A few refusals stay checks in code for their clearer messages; their schema is
stated with `extra_json_schema` next to the field (`_refused`). Responses are plain dicts.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from omni.api.errors import bad_request
from omni.api.protocol_media import (  # noqa: F401 (re-exported: the routes name them P.*)
    CHAT_AUDIO_FORMATS,
    MAX_IMAGE_PROMPT_CHARS,
    MAX_SPEECH_CHARS,
    CHAT_SPEECH_REFUSED,
    END,
    SPEECH_FORMATS,
    SPEECH_REFUSED,
    VOICE_NAME,
    VOICE_NAME_RE,
    ChatAudioFormat,
    ImageGenerationRequest,
    SpeechFormat,
    SpeechRequest,
    Speed,
    VideoCreateRequest,
    Voice,
    VoiceId,
    VoiceName,
    VoiceSpec,
    check_speed,
    check_voice_spec,
    voice_name,
)
from omni.api.refused import RefusedParams, first_refused
from omni.api.refused import refused as _refused
from omni.config_checks import SAMPLING_RANGES
from omni.engines.logprobs import MAX_LOGPROBS


class InputAudio(msgspec.Struct):
    data: str                 # base64 of the file
    format: str = "wav"


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class AudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


# vLLM's `audio_url` part (what vllm-omni's example clients send): a data URL of WAV audio. omni fetches no
# URL (a server that fetches what clients name reaches whatever they name).
AUDIO_DATA_URL = r"^data:audio/(wav|x-wav|wave|vnd\.wave);base64,"


class AudioUrl(msgspec.Struct):
    url: Annotated[str, msgspec.Meta(pattern=AUDIO_DATA_URL)]


class AudioUrlPart(msgspec.Struct, tag_field="type", tag="audio_url"):
    audio_url: AudioUrl


ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | AudioPart | AudioUrlPart] | None = None
    name: str | None = None
    # A tool call history: refused by name (chat_messages), as `tools` is.
    tool_calls: Annotated[list | None, _refused([None, []])] = None
    tool_call_id: Annotated[str | None, _refused([None])] = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False   # extension (vLLM): usage on every chunk, with include_usage


class AudioOptions(msgspec.Struct):
    voice: Voice = None
    format: ChatAudioFormat = "wav"


Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# JSON integers have no size; a stage's message (msgpack) holds 64 bits. Every integer a stage gets is
# bounded to int64, vLLM's bound on seed, so a larger one is a 400 naming it, not encoding's 500.
INT64_MAX = 2**63 - 1
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]             # -1 and 0: off
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=INT64_MAX)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]
MAX_STOP_STRINGS = 16


class _Sampling(RefusedParams, kw_only=True):
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None             # extension
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    ignore_eos: bool = False               # extension
    stream: bool | None = False            # null: OpenAI's default, as for the others
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = 1
    include_stop_str_in_output: bool | None = False   # extension (vLLM): the stop string stays in the text
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None   # extension (vLLM)
    logit_bias: dict[Annotated[str, msgspec.Meta(pattern=r"^[0-9]+" + END)],
                     Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    # extension (vLLM); more than the request's max_tokens: max_tokens ends it first
    min_tokens: MinTokens = 0
    # extension (vLLM): the answer's id is chatcmpl- / cmpl- and this, as vLLM's; the stages keep ids of
    # their own (two requests may send one id). Printable ASCII, no spaces: it is echoed back.
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[!-~]{1,256}" + END)] | None = None
    # Declared so that they are refused by name (check_sampling), never silently ignored.
    response_format: Annotated[dict | None, _refused([{"type": "text"}, {}, None])] = None
    tools: Annotated[list | None, _refused([[], None])] = None
    tool_choice: Annotated[str | dict | None, _refused(["none", None])] = None
    best_of: Annotated[int | None, _refused([1, None])] = None
    suffix: Annotated[str | None, _refused(["", None])] = None


def no_client_sampling() -> _Sampling:
    """A request that sets no sampling value: the deploy's defaults alone (an image request's writer LM)."""
    return _Sampling()


class StageSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One stage's entry of vllm-omni's `sampling_params_list`: that stage's sampling, whole (vLLM's
    SamplingParams defaults for what it leaves out, as vllm-omni builds it). A key omni does not take
    is refused by name. `detokenize` is taken as what omni does anyway (text out of the stage taking
    the prompt, codes and audio out of the others). max_tokens: None is vLLM's 16 (FrontendState)."""
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=64)] = []
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] = 1.0
    min_tokens: MinTokens = 0
    detokenize: bool = True


MAX_STAGES = 16
# extension (vLLM): variables for the chat template (`enable_thinking`, vllm-omni's `use_tts_template`)
TemplateKwargs = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Any], msgspec.Meta(max_length=32)]


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    chat_template_kwargs: TemplateKwargs | None = None
    # extension (vLLM): null is "unless continue_final_message"; both true is a 400
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False   # extension (vLLM): the model continues the last message
    echo: Annotated[bool | None, _refused([False, None])] = None
    # extension (vllm-omni): the voice at the top level, where OpenAI's clients put it in `audio`
    voice: VoiceName | None = None
    speaker: VoiceName | None = None
    # extension (vllm-omni): entry i is stage i's sampling; entry 0 replaces the request's own fields
    sampling_params_list: Annotated[list[StageSampling], msgspec.Meta(max_length=MAX_STAGES)] | None = None
    max_completion_tokens: MaxTokens | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None   # needs logprobs: true
    add_special_tokens: bool = False     # extension (vLLM): BOS etc. on top of the template's
    # vllm-omni's TTS fields (CHAT_SPEECH_REFUSED), declared to be refused by name
    ref_audio: Annotated[str | list | None, _refused([None, ""])] = None
    ref_text: Annotated[str | None, _refused([None, ""])] = None
    task_type: Annotated[str | None, _refused([None, ""])] = None
    language: Annotated[str | None, _refused([None, ""])] = None
    instructions: Annotated[str | None, _refused([None, ""])] = None
    speaker_embedding: Annotated[list | None, _refused([None, []])] = None
    x_vector_only_mode: Annotated[bool | None, _refused([None, False])] = None
    max_new_tokens: Annotated[int | None, _refused([None])] = None
    extra_params: Annotated[dict | None, _refused([None, {}])] = None


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_LISTS = {"anyOf": [_IDS, {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                           {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 1}]}


class CompletionRequest(_Sampling, kw_only=True):
    # OpenAI's four forms: text, token ids, and one prompt in a list of either (one_prompt checks
    # the list's shape, which the schema states; a batch would need one choice per prompt)
    prompt: (Annotated[str, msgspec.Meta(min_length=1)]
             | Annotated[list[TokenId | str | list[TokenId]], msgspec.Meta(min_length=1, extra_json_schema=_PROMPT_LISTS)])
    echo: Annotated[bool | None, _refused([False, None])] = False
    # top-k per token, 0..20 (vLLM's max_logprobs)
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_special_tokens: bool = True      # extension (vLLM)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: `prompt` (raw text) or `messages` (through the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    # vLLM's defaults: true with `prompt`, false with `messages` (on top of the template's)
    add_special_tokens: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    add_generation_prompt: bool | None = None     # with `messages`, as chat's
    continue_final_message: bool | None = False
    return_token_strs: bool | None = False        # extension (vLLM): `token_strs`, the tokens' own strings


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# vllm-omni's: the stages to sleep or wake (none: every stage); the query string's too (api/control.py, routes.py)
MAX_STAGE_ID, MAX_STAGE_IDS = 1023, 64
StageIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_STAGE_ID)]],
                     msgspec.Meta(min_length=1, max_length=MAX_STAGE_IDS)]


class SleepRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # none: 2 on /v1/omni/sleep (vllm-omni's default), 1 on /sleep (vLLM's)
    level: Annotated[int, msgspec.Meta(ge=1, le=2)] | None = None
    # vLLM's: abort ends the requests in flight (503), wait lets them finish first. Its `keep` is refused.
    mode: Literal["abort", "wait"] = "abort"
    stage_ids: StageIds | None = None


class WakeupRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    stage_ids: StageIds | None = None


# What a type cannot say about itself, merged into its schema (openapi.py): /tokenize takes
# exactly one of `prompt` and `messages`; stream_options needs stream: true; add_generation_prompt
# and continue_final_message are not both true.
_STREAM_OPTIONS = {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
                   "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_ONE_ENDING = {"not": {"required": ["add_generation_prompt", "continue_final_message"],
                       "properties": {"add_generation_prompt": {"const": True},
                                      "continue_final_message": {"const": True}}}}
SCHEMA_EXTRA = {
    "TokenizeRequest": {"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}],
        "allOf": [_ONE_ENDING]},
    "ChatCompletionRequest": {"allOf": [_STREAM_OPTIONS, _ONE_ENDING]},
    "CompletionRequest": {"allOf": [_STREAM_OPTIONS]},
}


_PATH_RE = re.compile(r"\$\.?([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*)")


def decode_body(body: bytes, type_: type) -> Any:
    """Decode a JSON body into `type_`; any problem is a 400 naming the parameter. (Its size was
    bounded as it arrived: omni.api.limits.)"""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        # Lax like vLLM's pydantic models: JSON Schema's integer 1.0 is an int, "2" a number.
        return msgspec.json.decode(body, type=type_, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH_RE.search(msg)
        param = m.group(1) if m else None
        if param is None and ("missing required field" in msg or "unknown field" in msg):
            f = re.search(r"`([^`]+)`", msg)
            param = f.group(1) if f else None
        if param is not None and param.endswith("audio_url.url"):
            msg += " (a data URL of WAV audio, data:audio/wav;base64,...: omni fetches no URL)"
        raise bad_request(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except RecursionError:   # msgspec's answer past Python's recursion limit, not a DecodeError
        raise bad_request("malformed JSON body: JSON nested too deeply") from None


def _unsupported(req: _Sampling) -> str | None:
    """The first parameter set to something omni does not do yet."""
    if req.tools:
        return "tools"
    if req.tool_choice not in (None, "none"):
        return "tool_choice"
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        return "response_format"
    if req.best_of not in (None, 1):
        return "best_of"
    if req.suffix:
        return "suffix"
    if getattr(req, "echo", False):
        return "echo"
    return None


RANGED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "temperature", "top_p",
          "top_k", "seed")


def check_sampling(req: _Sampling) -> int | None:
    """Range checks shared by chat and completions (max_tokens is checked later, with the prompt);
    returns the request's logprobs k (logprobs_k), for FrontendState.sampling."""
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n} is not supported; only n=1", param="n")
    name = _unsupported(req)
    if name is not None:
        raise bad_request(f"{name} is not supported by this server yet", param=name)
    named = first_refused(req) or (first_refused(req, CHAT_SPEECH_REFUSED)
                                   if isinstance(req, ChatCompletionRequest) else None)
    if named is not None:
        raise bad_request(f"{named[0]}: {named[1]}", param=named[0])
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")   # vLLM's rule
    for name in RANGED:   # the ranges a deploy's default_sampling_params get too
        v = getattr(req, name)
        ok, wanted = SAMPLING_RANGES[name]
        if v is not None and not ok(v):
            raise bad_request(f"{name}={v} must be {wanted}", param=name)
    for k, v in (req.logit_bias or {}).items():
        if not k.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        if not -100.0 <= v <= 100.0:
            raise bad_request(f"logit_bias[{k}]={v} must be in [-100, 100]", param="logit_bias")
    for s in stop_list(req.stop):
        if not s:
            raise bad_request("stop strings must not be empty", param="stop")
    if len(stop_list(req.stop)) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise bad_request("stop_token_ids must be non-negative", param="stop_token_ids")
    return logprobs_k(req)


def logprobs_k(req: _Sampling) -> int | None:
    """The request's logprobs as the engines take them: None (off) or top-k >= 0. Checked as vLLM's
    server checks them: chat `top_logprobs` needs `logprobs: true`; at most vLLM's max_logprobs."""
    if isinstance(req, ChatCompletionRequest):
        name, k = "top_logprobs", req.top_logprobs
        if not req.logprobs:
            if k:   # vLLM lets top_logprobs 0 through without logprobs
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        k = 0 if k is None else k
    else:
        name, k = "logprobs", getattr(req, "logprobs", None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{name}={k} must be in [0, {MAX_LOGPROBS}]", param=name)
    return k


def one_prompt(prompt: str | list) -> str | list[int]:
    """A completion's prompt as text or token ids. OpenAI's list forms hold one prompt here:
    token ids, [text] or [[ids]]; a batch of prompts is a 400 (one choice per request)."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return prompt
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
                          param="prompt")
    if len(prompt) != 1:
        raise bad_request("prompt must be text, token ids, or one prompt as [text] or [[ids]]", param="prompt")
    one = prompt[0]
    if isinstance(one, list) and not one:
        raise bad_request("prompt must not be empty", param="prompt")
    return one


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def chat_voice(req: ChatCompletionRequest) -> tuple[str | None, str]:
    """The voice a chat asks for (OpenAI's `audio.voice`, or vllm-omni's top-level `voice` / `speaker`)
    and the field that named it."""
    voice = req.audio.voice if req.audio else None
    named = {"audio.voice": voice_name(voice), "voice": req.voice, "speaker": req.speaker}
    return one_voice(named), voice_field(named)


def voice_field(named: dict[str, str | None]) -> str:
    """The field the client named its voice in (the first of `named` when none did): an unknown voice's 404 names it."""
    return next((k for k, v in named.items() if v and v.strip()), next(iter(named)))


def one_voice(named: dict[str, str | None]) -> str | None:
    """The voice the fields name (stripped), None when none does; two that differ (case and
    surrounding blanks aside) are a 400 naming them. Chat and speech share it."""
    named = {k: v for k, v in named.items() if v and v.strip()}
    if len({v.strip().lower() for v in named.values()}) > 1:
        raise bad_request(f"{' and '.join(named)} name different voices ({', '.join(map(repr, named.values()))})",
                          param=next(iter(named)))
    return next((v.strip() for v in named.values()), None)


def _tag(part) -> str:
    return type(part).__struct_config__.tag


def chat_messages(req: ChatCompletionRequest, audios: list | None = None) -> list[dict]:
    """The messages as plain dicts for the chat template (text parts joined). `input_audio` parts
    become `{"type": "audio"}` parts in place (the template draws the placeholder) and their
    payloads are appended to `audios` as (param path, InputAudio); without `audios` they are refused."""
    if not req.messages:   # decoding refuses an empty list; a TokenizeRequest may carry one
        raise bad_request("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.tool_calls or m.tool_call_id is not None:   # a tool's history: tools are refused too
            name = "tool_calls" if m.tool_calls else "tool_call_id"
            raise bad_request(f"messages[{i}].{name}: tool calls are not supported by this server",
                              param=f"messages[{i}].{name}")
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts, has_audio = [], False
            for j, p in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if isinstance(p, (AudioPart, AudioUrlPart)):
                    if audios is None:
                        raise bad_request(f"{where}.type `{_tag(p)}` is not supported; only text parts",
                                          param=f"{where}.type")
                    if isinstance(p, AudioPart):
                        audios.append((f"{where}.input_audio", p.input_audio))
                    else:   # the pattern held: the payload follows the first comma
                        audios.append((f"{where}.audio_url.url", InputAudio(p.audio_url.url.split(",", 1)[1])))
                    parts.append({"type": "audio"})
                    has_audio = True
                    continue
                parts.append({"type": "text", "text": p.text})
            text = parts if has_audio else "\n".join(q["text"] for q in parts)
        d = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def chat_ending(req: ChatCompletionRequest | TokenizeRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM takes them; the first defaults to
    "unless the second" (vLLM makes a client say false), both true is a 400."""
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          param="continue_final_message")
    return (not cont if req.add_generation_prompt is None else req.add_generation_prompt), cont
