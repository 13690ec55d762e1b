"""A chat audio part's WAV rate must be a multiple of audio.RATE_STEP (25 Hz): a coprime rate such as
383999 Hz has 16000 phases to 16 kHz, whose 50 MB of filter weights never fit the cache, so each part
cost 0.2-0.65 s of the frontend's CPU; every rate a recorder writes is such a multiple and resamples
from weights the cache keeps."""

import base64
import math

import httpx
import numpy as np
import pytest

from omni import audio
from omni.api import build_app
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_audio_in import SIG, count_sinc, pcm_wav, with_rate

STANDARD = (1000, 5000, 6000, 7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000,
            88200, 96000, 176400, 192000, 352800, 384000)


@pytest.mark.parametrize("rate", [383999, 191999, 127997, 44101, 16001])
def test_a_rate_off_the_step_is_refused_naming_it(rate):
    with pytest.raises(ValueError, match=f"sample rate {rate} Hz is not a multiple of 25 Hz"):
        audio.read_wav(with_rate(pcm_wav(SIG, 16000, 1), rate))


def test_every_standard_rate_is_taken_and_its_weights_fit_one_cached_block(monkeypatch):
    for rate in STANDARD:
        assert audio.read_wav(with_rate(pcm_wav(SIG, 16000, 1), rate))[1] == rate
    worst = audio.MAX_RATE - audio.MAX_RATE % audio.RATE_STEP - audio.RATE_STEP   # 383975 Hz: 640 phases
    assert 16000 // math.gcd(worst, 16000) == 640
    evaluated = count_sinc(monkeypatch)
    x = np.zeros(worst, np.float32)
    audio.resample(x, worst, 16000)
    assert len(evaluated) == 1          # one block of weights (640 phases x 792 taps) ...
    evaluated.clear()
    audio.resample(x, worst, 16000)
    assert evaluated == []              # ... kept for the next part (383999 Hz: 13 blocks, each part)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_chat_audio_part_off_the_step_is_a_400_naming_it(tokenizer, anyio_backend):
    orch = FakeOrchestrator(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    app.state.frontend.audio_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")   # takes audio
    wav = with_rate(pcm_wav(SIG[:100], 16000, 1), 383999)
    body = chat_body(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]}])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param="messages[0].content[0].input_audio.data", contains="383999 Hz is not a multiple of 25")
    assert orch.requests == []
