"""/v1/audio/voices as vllm-omni's clients use it: GET also answers its `voices` (names) and
`uploaded_voices` keys beside omni's `data`, and its upload form (name, consent, audio_sample) is a 400
naming audio_sample (no voice cloning here), not a Content-Type refusal."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_the_list_has_vllm_omnis_keys_too(tokenizer):  # noqa: F811
    _, c = make(tokenizer, speech_entry_stage=1)
    assert (await c.post("/v1/audio/voices", json={"name": "slow", "speed": 0.5})).status_code == 201
    d = (await c.get("/v1/audio/voices")).json()
    assert [v["name"] for v in d["data"]] == ["joe", "slow"]
    assert d["voices"] == ["joe", "slow"]
    assert d["uploaded_voices"] == [{"name": "slow", "base": "joe", "speed": 0.5, "builtin": False}]


@pytest.mark.parametrize("speakers", [(), ("chelsie",)])
async def test_an_upload_form_is_refused_naming_audio_sample(tokenizer, speakers):  # noqa: F811
    kw = {"audio_out": True, "speakers": speakers} if speakers else {"speech_entry_stage": 1}
    _, c = make(tokenizer, **kw)
    r = await c.post("/v1/audio/voices", data={"name": "mine", "consent": "true"},
                     files={"audio_sample": ("f.wav", b"RIFF0000WAVE", "audio/wav")})
    assert_error(r, 400, "audio_sample", "voice cloning")
    r = await c.post("/v1/audio/voices", data={"name": "mine"})      # urlencoded: the same
    assert_error(r, 400, "audio_sample", "voice cloning")
    assert "mine" not in (await c.get("/v1/audio/voices")).json()["voices"]
    r = await c.post("/v1/audio/voices", content=b'{"name": "x"}', headers={"content-type": "text/plain"})
    assert_error(r, 400, "Content-Type")          # the browser check still holds for other types


async def test_speech_ref_audio_says_cloning_is_not_supported(tokenizer):  # noqa: F811
    _, c = make(tokenizer, speech_entry_stage=1)
    for field in ("ref_audio", "ref_text"):
        r = await c.post("/v1/audio/speech", json={"input": "hi", field: "x"})
        assert_error(r, 400, field, "voice cloning is not supported")
        assert "upload" not in r.json()["error"]["message"]
