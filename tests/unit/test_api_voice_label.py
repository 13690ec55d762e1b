"""The audio metrics' `voice` label is the speaker as resolved, not as sent: the speakers match any
case, so a label per spelling would let any client add series without bound."""

from __future__ import annotations

import re

import pytest

from tests.unit.test_api import FakeOrchestrator, chat_body, tokenizer  # noqa: F401
from omni.api import build_app

import httpx

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


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
