"""vllm-omni's /v1/realtime (its realtime example's WebSocket) and any other WebSocket path are refused by
name: a 404 in OpenAI's error shape saying the endpoint is not supported. The upgrade was closed unaccepted,
which Hypercorn answered 403 with no body, and a GET was a bare 'Not Found'. Real sockets through omni's
Hypercorn (omni/api/serve.py): the upgrade's answer is Hypercorn's."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from omni.api.app import build_app
from omni.api.limits import HttpLimits
from tests.unit.api_fakes import FakeOrchestrator, served_in_thread, tokenizer  # noqa: F401 (fixture)


@pytest.fixture
def server(tokenizer):  # noqa: F811
    """(host, port) of the frontend app served by omni's Hypercorn on a thread's loop."""
    app = build_app(FakeOrchestrator(tokenizer, "hi"), tokenizer, served_model_name="tiny", max_model_len=128)
    with served_in_thread(app, HttpLimits()) as addr:
        yield addr


def upgrade(addr, path: str) -> tuple[int, dict]:
    """A WebSocket handshake as a client sends it: the status and JSON body of the answer."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += s.recv(65536)
        return int(head.split()[1]), json.loads(body)


def test_realtime_and_other_websockets_are_refused_by_name(server):
    status, body = upgrade(server, "/v1/realtime?model=tiny")
    assert status == 404, body
    assert body["error"]["code"] == "endpoint_not_supported" and body["error"]["type"] == "not_found_error"
    assert "/v1/realtime: the Realtime API" in body["error"]["message"] and "not supported" in body["error"]["message"]
    status, body = upgrade(server, "/v1/chat/completions")
    assert status == 404 and "WebSocket endpoints are not supported" in body["error"]["message"]
    for method in ("GET", "POST"):
        r = httpx.request(method, f"http://{server[0]}:{server[1]}/v1/realtime", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "endpoint_not_supported", r.text
    # the route table's own paths answer as before, and the OpenAPI description lists no realtime
    r = httpx.get(f"http://{server[0]}:{server[1]}/openapi.json", timeout=10)
    assert r.status_code == 200 and "/v1/realtime" not in r.json()["paths"]
