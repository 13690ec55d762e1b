"""Endpoints vllm-omni serves and omni does not, refused by name instead of answered as unknown paths.

vllm-omni's realtime example connects a WebSocket to /v1/realtime; with no WebSocket route, Starlette
closed the upgrade unaccepted, which Hypercorn answers 403 with no body, and a GET was a bare 404. omni
serves no WebSocket endpoint: every upgrade gets an HTTP 404 in OpenAI's error shape naming the
endpoint (the ASGI WebSocket denial response, which Hypercorn sends as it is), as does plain HTTP to
/v1/realtime. Not in the route table: the OpenAPI description lists what is served."""

from __future__ import annotations

from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from omni.api.errors import error_response

REALTIME = "/v1/realtime"


def refusal(path: str) -> Response:
    what = ("the Realtime API (vllm-omni's WebSocket endpoint) is not supported by this server; "
            "/v1/chat/completions with stream: true streams text and audio" if path == REALTIME
            else "WebSocket endpoints are not supported by this server")
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
    return [Route(REALTIME, _Refuse()), WebSocketRoute("/{path:path}", _Refuse())]
