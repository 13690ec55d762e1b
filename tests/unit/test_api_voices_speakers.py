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


async def test_a_missing_default_voice_is_named_not_none(tokenizer):  # noqa: F811
    """A request naming no voice resolves the default; its 404 said "voice `None`"."""
    from omni.api.errors import APIError
    from omni.api.state import FrontendState

    s = FrontendState(None, None, served_model_name="m", model_aliases=(), frontend_index=0, max_model_len=4096,
                      default_max_tokens=None, max_tokens_limit=None, speech_entry_stage=0, voices=None,
                      sampling_defaults=None, speakers=("chelsie", "ethan"), default_voice="nosuch")
    with pytest.raises(APIError, match=r"^voice `nosuch` does not exist; available: chelsie, ethan$") as e:
        await s.voice(None)
    assert e.value.status == 404
    assert await s.voice("Ethan") == ("ethan", None)
