"""A client that leaves while its body is still arriving (Content-Length: 100, 9 bytes, then gone) is a 499
nobody reads, counted as one, with no ERROR line: Starlette's ClientDisconnect from reading the body (JSON
or a form) was an unexpected error, a 500 in the metrics and a logged traceback per request."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from omni.api import build_app
from omni.api.jobs import LocalKv
from tests.unit.api_fakes import FakeOrchestrator, anyio_backend, tokenizer  # noqa: F401 (fixtures)
from tests.unit.test_api_videos import frontend

pytestmark = pytest.mark.anyio


async def leave_mid_body(app, path: str, ctype: bytes, first: bytes = b'{"model":') -> list:
    """POST `path` declaring 100 bytes, send `first`, then disconnect; what the app sent back."""
    sent: list = []
    messages = [{"type": "http.request", "body": first, "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
             "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", ctype), (b"content-length", b"100")], "scheme": "http",
             "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


async def counted(app) -> list[str]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        text = (await c.get("/metrics")).text
    return [line for line in text.splitlines() if line.startswith("omni_api_requests_total{")]


async def test_a_client_gone_mid_body_is_a_quiet_499(tokenizer, caplog):
    app = build_app(FakeOrchestrator(tokenizer, "hi"), tokenizer, served_model_name="tiny", max_model_len=128)
    paths = ("/v1/chat/completions", "/v1/completions", "/v1/omni/jobs", "/tokenize", "/detokenize")
    with caplog.at_level(logging.DEBUG):
        for path in paths:
            sent = await leave_mid_body(app, path, b"application/json")
            assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499], (path, sent)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    lines = await counted(app)
    for path in paths:
        assert any(f'route="{path}"' in line and 'status="499"} 1' in line for line in lines), (path, lines)
    assert not any('status="500"' in line for line in lines), lines


async def test_a_client_gone_mid_form_is_a_quiet_499(tmp_path, caplog):
    _, _, client = frontend(LocalKv(), tmp_path)
    app = client._transport.app
    with caplog.at_level(logging.DEBUG):
        sent = await leave_mid_body(app, "/v1/videos", b"multipart/form-data; boundary=x",
                                    b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na ca')
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499], sent
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any('route="/v1/videos"' in line and 'status="499"} 1' in line for line in await counted(app))
