"""Chat audio parts: OpenAI's `input_audio` and vLLM's `audio_url` with a data URL (what vllm-omni's
example clients send); a URL to fetch is refused by name."""

import base64

import httpx
import numpy as np
import pytest

from omni.api import build_app
from omni.api import protocol as P
from omni.api.errors import APIError
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)
from tests.unit.test_audio_in import SIG, pcm_wav, with_rate

WAV = base64.b64encode(b"RIFF....WAVEfmt ").decode()


def decode(parts: list) -> P.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": parts}]}
    return P.decode_body(P.msgspec.json.encode(body), P.ChatCompletionRequest)


@pytest.mark.parametrize("mime", ["audio/wav", "audio/x-wav", "audio/wave"])
def test_an_audio_url_data_url_is_an_audio_part_like_input_audio(mime):
    audios: list = []
    messages = P.chat_messages(decode([{"type": "audio_url", "audio_url": {"url": f"data:{mime};base64,{WAV}"}},
                                       {"type": "text", "text": "What do you hear?"}]), audios)
    assert messages == [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What do you hear?"}]}]
    assert audios == [("messages[0].content[0].audio_url.url", P.InputAudio(WAV, "wav"))]
    same: list = []
    P.chat_messages(decode([{"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
                            {"type": "text", "text": "What do you hear?"}]), same)
    assert [a for _, a in same] == [a for _, a in audios]


@pytest.mark.parametrize("url", ["https://example.com/a.wav", "file:///etc/passwd", "data:audio/ogg;base64,AAAA"])
def test_an_audio_url_to_fetch_or_not_wav_is_a_400_naming_it(url):
    with pytest.raises(APIError) as e:
        decode([{"type": "audio_url", "audio_url": {"url": url}}])
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].audio_url.url"
    assert "omni fetches no URL" in str(e.value)


def test_where_audio_is_not_taken_the_part_type_is_named():
    with pytest.raises(APIError) as e:
        P.chat_messages(decode([{"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{WAV}"}}]))
    assert e.value.param == "messages[0].content[0].type" and "`audio_url` is not supported" in str(e.value)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_input_audio_wav_at_an_absurd_sample_rate_is_a_400_naming_the_part(tokenizer, anyio_backend):
    """A 4 GHz header made resampling cost gigabytes; it is refused before any decoding work."""
    orch = FakeOrchestrator(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    app.state.frontend.audio_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")   # takes audio
    wav = with_rate(pcm_wav(SIG[:100], 16000, 1), 0xFFFFFFFF)   # short: cheap on the old code too
    body = chat_body(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]}])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param="messages[0].content[0].input_audio.data", contains="4294967295 Hz")
    assert orch.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_audio_parts_adding_up_past_the_total_limit_are_a_400_naming_it(tokenizer, anyio_backend):
    """Each part within its own 600 s, together past what a request's AddRequest carries (8-bit 1 kHz WAV decodes
    to 64 times its size): refused before the last part is resampled, nothing sent."""
    from omni.api.state import MAX_AUDIO_TOTAL_SECONDS
    from omni.orchestrator.limits import MAX_INLINE_BYTES

    assert MAX_AUDIO_TOTAL_SECONDS * 16000 * 4 <= MAX_INLINE_BYTES
    orch = FakeOrchestrator(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    app.state.frontend.audio_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")   # takes audio
    part = {"type": "input_audio", "input_audio": {"format": "wav", "data": base64.b64encode(
        pcm_wav(np.zeros(1000 * 500, np.float32), 1000, 1)).decode()}}     # 500 s, 500 KB
    body = chat_body(messages=[{"role": "user", "content": [part, part]}])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param="messages[0].content[1].input_audio.data",
                 contains=f"add up to 1000 s; the limit is {MAX_AUDIO_TOTAL_SECONDS} s a request")
    assert orch.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_audio_parts_past_the_prompt_stages_limit_are_a_400_naming_the_first_extra(tokenizer, anyio_backend):
    """They reached the thinker, every part decoded and resampled, and came back a 400 with no param; now the
    frontend counts them first (the payloads here are not even base64: none is decoded)."""
    orch = FakeOrchestrator(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    app.state.frontend.audio_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")   # takes audio
    app.state.frontend.audio_limit = 1
    bad = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,bm90IGEgd2F2"}}
    body = chat_body(messages=[{"role": "user", "content": "hi"},
                               {"role": "user", "content": [bad, {"type": "text", "text": "and"}, url, bad]}])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param="messages[1].content[2]",
                 contains="At most 1 audio(s) may be provided in one prompt; this one has 3 (limit_mm_per_prompt); "
                          "messages[1].content[2] is the first past it")
    assert orch.requests == []
