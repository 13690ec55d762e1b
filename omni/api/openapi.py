"""Hand-written OpenAPI schemas of the request bodies (enough for clients and fuzzers); the
paths come from the route table (omni/api/routes.py)."""

from __future__ import annotations


def _obj(props: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required)}


_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}
_SAMPLING = {
    "model": _S, "max_tokens": _I, "temperature": _N, "top_p": _N, "top_k": _I, "seed": _I,
    "stop": {"oneOf": [_S, {"type": "array", "items": _S}]}, "stream": _B,
    "stream_options": _obj({"include_usage": _B}), "n": _I,
}
_MESSAGE = _obj({"role": _S, "content": {"oneOf": [_S, {"type": "array", "items": _obj(
    {"type": _S, "text": _S}, ("type",))}]}}, ("role",))

CHAT = _obj({**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE}, "max_completion_tokens": _I,
             "modalities": {"type": "array", "items": _S}, "audio": _obj({"voice": _S, "format": _S})},
            ("messages",))
COMPLETION = _obj({**_SAMPLING, "prompt": {"oneOf": [_S, {"type": "array", "items": _I}]}}, ("prompt",))
SPEECH = _obj({"model": _S, "input": _S, "voice": _S, "response_format": _S, "speed": _N}, ("input",))
VOICE = _obj({"name": _S, "base": _S, "speed": _N}, ("name",))
SLEEP = _obj({"level": _I})
JOB = _obj({"endpoint": _S, "body": _obj({})}, ("endpoint", "body"))
TOKENIZE = _obj({"model": _S, "prompt": _S, "messages": {"type": "array", "items": _MESSAGE},
                 "add_special_tokens": _B})
DETOKENIZE = _obj({"model": _S, "tokens": {"type": "array", "items": _I}}, ("tokens",))


def operation(body: dict | None, ok: str = "application/json") -> dict:
    op: dict = {"responses": {"200": {"description": "OK", "content": {ok: {}}},
                              "400": {"description": "Bad request (OpenAI error body)"},
                              "503": {"description": "No READY replica, or the engines are asleep"}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op
