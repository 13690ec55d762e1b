"""A preset's speed times the request's is held to the request's own range, [0.25, 4]: 4 x 4 reached the
pipeline as 16, which Piper refuses (it takes 0.1-10) with a 400 quoting an internal request id."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("preset, asked", [(4.0, 4.0), (0.25, 0.5), (3.0, 1.5)])
async def test_a_product_out_of_range_is_refused_by_name(tokenizer, preset, asked):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    assert (await c.post("/v1/audio/voices", json={"name": "p", "base": "joe", "speed": preset})).status_code == 201
    r = await c.post("/v1/audio/speech", json={"input": "hello", "voice": "p", "speed": asked})
    err = assert_error(r, 400, "speed", "voice `p`")
    assert f"{preset * asked:g}" in err["message"] and "[0.25, 4.0]" in err["message"]
    assert orch.requests == []      # nothing reached the pipeline


@pytest.mark.parametrize("preset, asked", [(2.0, 2.0), (0.5, 0.5), (4.0, 0.25)])
async def test_a_product_in_range_is_sent(tokenizer, preset, asked):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1)
    orch.audio_chunks = 1
    assert (await c.post("/v1/audio/voices", json={"name": "p", "base": "joe", "speed": preset})).status_code == 201
    r = await c.post("/v1/audio/speech", json={"input": "hello", "voice": "p", "speed": asked})
    assert r.status_code == 200, r.text
    assert (orch.requests[-1].voice, orch.requests[-1].speed) == ("joe", preset * asked)
