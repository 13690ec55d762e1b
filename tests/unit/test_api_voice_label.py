"""The audio metrics' `voice` label is the speaker as resolved, not as sent: the speakers match any
case, so a label per spelling would let any client add series without bound."""

from __future__ import annotations

import re

import pytest

from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401
from omni.api import build_app

import httpx

pytestmark = pytest.mark.anyio


async def test_a_speaker_in_any_case_is_one_series(tokenizer):  # noqa: F811
    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = 1
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, audio_out=True,
                    speech_entry_stage=1, speakers=("chelsie", "ethan"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for name in ("ethan", "ETHAN", "EtHaN"):
            body = chat_body(modalities=["text", "audio"], audio={"voice": name, "format": "wav"})
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        for name in ("Chelsie", "CHELSIE"):
            r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": name})
            assert r.status_code == 200, r.text
        text = (await c.get("/metrics")).text
    assert set(re.findall(r'voice="([^"]+)"', text)) == {"ethan", "chelsie"}
    assert re.search(r'^vllm_omni:audio_duration_s_count\{[^}]*voice="ethan"[^}]*\} 3$', text, re.M)


async def test_presets_are_labelled_by_their_base_voice(tokenizer):  # noqa: F811
    # Each preset's own name as a label kept its four series for good, after DELETE too: 500 presets
    # made a frontend's metrics text 4.25 MiB, past the 3 MiB the master publishes.
    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = 2
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for i in range(30):
            name = f"v{i:02d}" + "x" * 60
            assert (await c.post("/v1/audio/voices", json={"name": name, "base": "joe"})).status_code == 201
            r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": name, "response_format": "pcm"})
            assert r.status_code == 200, r.text
            assert (await c.delete(f"/v1/audio/voices/{name}")).status_code == 200
        text = (await c.get("/metrics")).text
    assert set(re.findall(r'voice="([^"]+)"', text)) == {"joe"}
    assert re.search(r'^vllm_omni:audio_duration_s_count\{[^}]*voice="joe"[^}]*\} 30$', text, re.M)
