"""Request bodies of the OpenAI-compatible routes, decoded with msgspec, and their checks.

Unknown fields are ignored (OpenAI clients send extras); wrong types and missing
required fields become a 400 naming the parameter. Responses are plain dicts.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from omni.api.errors import bad_request
from omni.engines.logprobs import MAX_LOGPROBS


class InputAudio(msgspec.Struct):
    data: str                 # base64 of the file
    format: str = "wav"


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    input_audio: InputAudio | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class AudioOptions(msgspec.Struct):
    voice: str | None = None
    format: str = "wav"


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None              # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False               # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None   # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0                       # extension (vLLM)
    # Declared so that they are refused by name (check_sampling), never silently ignored.
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    modalities: list[str] | None = None
    audio: AudioOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None           # 0..20, needs logprobs: true


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None               # 0..20 (vLLM's max_logprobs): top-k per token


class SpeechRequest(msgspec.Struct, kw_only=True):
    input: str
    model: str | None = None
    voice: str = "joe"
    response_format: str = "wav"
    speed: float = 1.0


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: `prompt` (raw text) or `messages` (through the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True       # with `prompt`; the chat template decides for `messages`


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class SleepRequest(msgspec.Struct, kw_only=True):
    level: int = 1


class VoiceSpec(msgspec.Struct, kw_only=True):
    name: str
    base: str = "joe"
    speed: float = 1.0


_PATH_RE = re.compile(r"\$\.?([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
MAX_STOP_STRINGS = 16
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def decode_body(body: bytes, type_: type) -> Any:
    """Decode a JSON body into `type_`; any problem is a 400 naming the parameter. (Its size was
    bounded as it arrived: omni.api.limits.)"""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH_RE.search(msg)
        param = m.group(1) if m else None
        if param is None and "missing required field" in msg:
            f = re.search(r"`([^`]+)`", msg)
            param = f.group(1) if f else None
        raise bad_request(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None


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


def check_sampling(req: _Sampling) -> None:
    """Range checks shared by chat and completions (max_tokens is checked later, with the prompt)."""
    if req.n != 1:
        raise bad_request(f"n={req.n} is not supported; only n=1", param="n")
    name = _unsupported(req)
    if name is not None:
        raise bad_request(f"{name} is not supported by this server yet", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise bad_request(f"{name}={v} must be in [-2, 2]", param=name)
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= 2.0:
        raise bad_request(f"repetition_penalty={req.repetition_penalty} must be in (0, 2]", param="repetition_penalty")
    for k, v in (req.logit_bias or {}).items():
        if not k.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        if not -100.0 <= v <= 100.0:
            raise bad_request(f"logit_bias[{k}]={v} must be in [-100, 100]", param="logit_bias")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens={req.min_tokens} must be >= 0", param="min_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request(f"temperature={req.temperature} must be in [0, 2]", param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request(f"top_p={req.top_p} must be in (0, 1]", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k={req.top_k} must be -1, 0 (off) or positive", param="top_k")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise bad_request(f"seed={req.seed} is out of range", param="seed")
    for s in stop_list(req.stop):
        if not s:
            raise bad_request("stop strings must not be empty", param="stop")
    if len(stop_list(req.stop)) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise bad_request("stop_token_ids must be non-negative", param="stop_token_ids")
    logprobs_k(req)


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


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def chat_messages(req: ChatCompletionRequest, audios: list | None = None) -> list[dict]:
    """The messages as plain dicts for the chat template (text parts joined). `input_audio` parts
    become `{"type": "audio"}` parts in place (the template draws the placeholder) and their
    payloads are appended to `audios` as (param path, InputAudio); without `audios` they are refused."""
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages[{i}].role `{m.role}` is not one of system, user, assistant, "
                              "developer, tool", param=f"messages[{i}].role")
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts, has_audio = [], False
            for j, p in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if p.type == "input_audio" and audios is not None:
                    if p.input_audio is None:
                        raise bad_request(f"{where} has no input_audio", param=f"{where}.input_audio")
                    audios.append((f"{where}.input_audio", p.input_audio))
                    parts.append({"type": "audio"})
                    has_audio = True
                    continue
                if p.type != "text":
                    supported = "text and input_audio parts" if audios is not None else "only text parts"
                    raise bad_request(f"{where}.type `{p.type}` is not supported; {supported}",
                                      param=f"{where}.type")
                if p.text is None:
                    raise bad_request(f"{where} has no text", param=f"{where}.text")
                parts.append({"type": "text", "text": p.text})
            text = parts if has_audio else "\n".join(q["text"] for q in parts)
        d = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def check_voice_spec(spec: VoiceSpec, builtin: list[str]) -> None:
    if not VOICE_NAME_RE.match(spec.name):
        raise bad_request(f"voice name `{spec.name}` must be 1-64 letters, digits, '_' or '-'",
                          param="name")
    if spec.base not in builtin:
        raise bad_request(f"base voice `{spec.base}` is not a built-in voice ({', '.join(builtin)})",
                          param="base")
    check_speed(spec.speed)


def check_speed(speed: float) -> None:
    if not 0.25 <= speed <= 4.0:
        raise bad_request(f"speed={speed} must be in [0.25, 4.0]", param="speed")
