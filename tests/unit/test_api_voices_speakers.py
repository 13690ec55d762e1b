"""/v1/audio/voices on a pipeline whose voices are the model's speakers (Qwen-Omni: it speaks through
chat, with no /v1/audio/speech entry): the speakers are its built-in voices, and it keeps no presets.
Every answer is one openapi.json documents for the route."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


def documented(spec: dict, path: str, method: str, status: int) -> bool:
    return str(status) in spec["paths"][path][method]["responses"]


async def test_speakers_are_the_voices(tokenizer):  # noqa: F811
    _, c = make(tokenizer, audio_out=True, speakers=("Chelsie", "ethan"))
    spec = (await c.get("/openapi.json")).json()
    r = await c.get("/v1/audio/voices")
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "list", "data": [
        {"name": "chelsie", "base": "chelsie", "speed": 1.0, "builtin": True},
        {"name": "ethan", "base": "ethan", "speed": 1.0, "builtin": True}],
        "voices": ["chelsie", "ethan"], "uploaded_voices": []}
    r = await c.post("/v1/audio/voices", json={"name": "fast", "base": "ethan", "speed": 2})
    err = assert_error(r, 400, None, "presets are not available")
    assert err["code"] == "voice_presets_unsupported" and "chelsie, ethan" in err["message"]
    assert documented(spec, "/v1/audio/voices", "post", 400)
    assert_error(await c.delete("/v1/audio/voices/Ethan"), 409, None, "built in")
    assert_error(await c.delete("/v1/audio/voices/zed"), 404, None, "does not exist")
    for status in (409, 404):
        assert documented(spec, "/v1/audio/voices/{name}", "delete", status)


async def test_a_pipeline_that_speaks_nothing_has_no_voices(tokenizer):  # noqa: F811
    _, c = make(tokenizer)
    spec = (await c.get("/openapi.json")).json()
    for r in (await c.get("/v1/audio/voices"), await c.post("/v1/audio/voices", json={"name": "a"}),
              await c.delete("/v1/audio/voices/a")):
        assert_error(r, 404, None, "no voices")
    assert documented(spec, "/v1/audio/voices", "get", 404)
