"""Images' `size`: OpenAI's "auto" is the deployment's default size; a malformed size (images or videos) is
refused in words naming `size`, not with msgspec's regex."""

from __future__ import annotations

import re

import pytest

from tests.unit.test_api_images import make
from tests.unit.test_api_videos import LocalKv, frontend

pytestmark = pytest.mark.anyio


async def test_auto_is_the_deployments_default_size():
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a cat", "size": "auto"})
    assert r.status_code == 200, r.text
    assert (orch.requests[0].image.width, orch.requests[0].image.height) == (64, 32)   # SETTINGS' 64x32
    schema = (await client.get("/openapi.json")).json()["components"]["schemas"]["ImageGenerationRequest"]
    pattern = schema["properties"]["size"]["anyOf"][0]["pattern"]
    assert re.fullmatch(pattern[1:-1], "auto") and re.fullmatch(pattern[1:-1], "64x32")


@pytest.mark.parametrize("size", ["big", "64", "64x32\n", "64X32", "6²x32", "x" * 70, "auto ", ""])
async def test_a_malformed_image_size_is_refused_in_words(size):
    _, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a cat", "size": size})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "size" and "size must be WIDTHxHEIGHT or auto" in err["message"], err
    assert "regex" not in err["message"]


async def test_a_malformed_video_size_is_refused_in_words(tmp_path):
    _, _, client = frontend(LocalKv(), tmp_path)
    for size in ("auto", "big", ""):   # OpenAI's videos have no "auto"; "" is no size either
        r = await client.post("/v1/videos", json={"prompt": "a dog", "size": size})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "size", r.text
        assert "size must be WIDTHxHEIGHT (e.g." in err["message"] and "regex" not in err["message"], err
