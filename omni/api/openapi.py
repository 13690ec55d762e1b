"""A hand-written OpenAPI description of the routes (enough for clients and fuzzers)."""

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


def _post(schema: dict, ok: str = "application/json") -> dict:
    return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": "OK", "content": {ok: {}}},
                                   "400": {"description": "Bad request (OpenAI error body)"}}}}


def _get() -> dict:
    return {"get": {"responses": {"200": {"description": "OK"}}}}


def spec(model: str) -> dict:
    return {
        "openapi": "3.0.3",
        "info": {"title": f"omni frontend ({model})", "version": "0.1.0"},
        "paths": {
            "/v1/chat/completions": _post(_obj({**_SAMPLING, "messages": {"type": "array", "items": _MESSAGE},
                                                "max_completion_tokens": _I,
                                                "modalities": {"type": "array", "items": _S},
                                                "audio": _obj({"voice": _S, "format": _S})}, ("messages",))),
            "/v1/completions": _post(_obj({**_SAMPLING, "prompt": {"oneOf": [_S, {"type": "array", "items": _I}]}},
                                          ("prompt",))),
            "/v1/audio/speech": _post(_obj({"model": _S, "input": _S, "voice": _S, "response_format": _S,
                                            "speed": _N}, ("input",)), ok="audio/wav"),
            "/v1/audio/voices": {**_get(), **_post(_obj({"name": _S, "base": _S, "speed": _N}, ("name",)))},
            "/v1/omni/sleep": _post(_obj({"level": _I})),
            "/v1/omni/wakeup": {"post": {"responses": {"200": {"description": "OK"}}}},
            "/v1/omni/is_sleeping": _get(),
            "/v1/omni/jobs": {**_get(), **_post(_obj({"endpoint": _S, "body": _obj({})}, ("endpoint", "body")))},
            "/v1/omni/jobs/{job_id}": {**_get(), "delete": {"responses": {"200": {"description": "OK"}}}},
            "/v1/omni/jobs/{job_id}/content": _get(),
            "/v1/models": _get(),
            "/tokenize": _post(_obj({"model": _S, "prompt": _S, "messages": {"type": "array", "items": _MESSAGE},
                                     "add_special_tokens": _B})),
            "/detokenize": _post(_obj({"model": _S, "tokens": {"type": "array", "items": _I}}, ("tokens",))),
            "/health": {"get": {"responses": {"200": {"description": "OK"}, "503": {"description": "unhealthy"}}}},
            "/metrics": _get(),
        },
    }
