"""Endpoints vllm-omni or vLLM serves and omni does not, refused by name instead of answered as unknown paths.

vllm-omni's realtime example connects a WebSocket to /v1/realtime; with no WebSocket route, Starlette
closed the upgrade unaccepted, which Hypercorn answers 403 with no body, and a GET was a bare 404. omni
serves no WebSocket endpoint: every upgrade gets an HTTP 404 in OpenAI's error shape naming the
endpoint (the ASGI WebSocket denial response, which Hypercorn sends as it is), as does plain HTTP to
/v1/realtime or to a path of NOT_SERVED, whatever the method. Not in the route table: the OpenAPI
description lists what is served. They come before the route table's routes: /v1/videos/sync would
match /v1/videos/{video_id} (a 405: only GET and DELETE)."""

from __future__ import annotations

from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from omni.api.errors import error_response

REALTIME = "/v1/realtime"

_BATCH = "send one request per input, or queue each as POST /v1/omni/jobs"
_AUDIO_IN = "/v1/chat/completions takes the audio as an input_audio part of a message"
_POOLING = "pooling models (embeddings, classification, scoring, reranking) are not served by omni"
_PAUSE = "omni stops generation only by sleeping: POST /v1/omni/sleep, /v1/omni/wakeup, GET /v1/omni/is_sleeping"
_LORA = "omni serves no LoRA adapters"
_STATUS = "`omni status` shows the deployment's stages, replicas and devices"
_WEIGHTS = "weight updates and RL rollouts are not supported: a stage loads its weights at its start"
_PROFILE = "profiling is not supported by this server (omni refuses --profiler-config)"
# path -> what it is and where to go instead (vllm-omni's serving README, vLLM's API server)
NOT_SERVED: dict[str, str] = {
    "/v1/videos/sync": "blocking video generation is not supported: POST /v1/videos, then GET "
                       "/v1/videos/{video_id}/content once it is completed (or POST /v1/omni/jobs)",
    "/v1/audio/speech/batch": f"batched speech is not supported: {_BATCH}",
    "/v1/chat/completions/batch": f"batched chat is not supported: {_BATCH}",
    "/v1/images/edits": "image edits are not supported: omni serves /v1/images/generations only",
    "/v1/audio/generate": "audio generation is not supported: /v1/audio/speech speaks a text",
    "/v1/responses": "the Responses API is not supported: use /v1/chat/completions",
    "/v1/messages": "the Anthropic Messages API is not supported: use /v1/chat/completions",
    "/v1/messages/count_tokens": "the Anthropic Messages API is not supported: POST /tokenize with messages counts them",
    "/v1/audio/transcriptions": f"transcription is not supported: {_AUDIO_IN}",
    "/v1/audio/translations": f"audio translation is not supported: {_AUDIO_IN}",
    **dict.fromkeys(("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                     "/v2/rerank"), _POOLING),
    "/inference/v1/generate": "vLLM's token generate API is not supported: /v1/completions takes a prompt of token ids",
    "/v1/chat/completions/render": "rendering is not supported: POST /tokenize with messages gives the templated prompt",
    "/v1/completions/render": "rendering is not supported: POST /tokenize gives a prompt's tokens",
    "/invocations": "SageMaker's endpoint is not supported: call /v1/chat/completions (or the route you mean) directly",
    **dict.fromkeys(("/pause", "/resume", "/is_paused"), _PAUSE),
    "/abort_requests": "aborting by request id is not supported: a request ends when its client disconnects",
    "/reset_prefix_cache": "resetting the prefix cache is not supported by this server",
    **dict.fromkeys(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"), _LORA),
    **dict.fromkeys(("/server_info", "/get_world_size"), _STATUS),
    **dict.fromkeys(("/update_weights", "/rollout/generate"), _WEIGHTS),
    **dict.fromkeys(("/start_profile", "/stop_profile"), _PROFILE),
    "/tokenizer_info": "the tokenizer's configuration is not served: POST /tokenize and /detokenize use it",
    "/load": "the server load is not served: GET /metrics (omni_api_requests_in_flight) and `omni status` show it",
    "/collective_rpc": "remote calls into the stage engines are not supported by this server",
    "/reset_mm_cache": "resetting the multimodal cache is not supported by this server",
    "/release_kv_cache_memory": "releasing the KV cache alone is not supported: POST /sleep?level=1 frees it "
                                "with the weights",
}


def refusal(path: str) -> Response:
    if path == REALTIME:
        what = ("the Realtime API (vllm-omni's WebSocket endpoint) is not supported by this server; "
                "/v1/chat/completions with stream: true streams text and audio")
    else:
        what = NOT_SERVED.get(path, "WebSocket endpoints are not supported by this server")
    return error_response(404, f"{path}: {what}", "not_found_error", code="endpoint_not_supported")


class _Refuse:
    """A plain ASGI app (Starlette wraps a function as a GET handler): every method, and upgrades."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            # a server without the denial extension: a close before accepting (1008: policy violation)
            await send({"type": "websocket.close", "code": 1008, "reason": "WebSocket endpoints are not supported"})
            return
        await refusal(scope["path"])(scope, receive, send)


def routes() -> list:
    """Placed before the route table's routes (see the module's docstring)."""
    refuse = _Refuse()
    return [Route(p, refuse) for p in (REALTIME, *NOT_SERVED)] + [WebSocketRoute("/{path:path}", refuse)]
