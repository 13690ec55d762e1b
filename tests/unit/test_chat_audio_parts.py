"""Chat audio parts: OpenAI's `input_audio` and vLLM's `audio_url` with a data URL (what vllm-omni's
example clients send); a URL to fetch is refused by name."""

import base64

import pytest

from omni.api import protocol as P
from omni.api.errors import APIError

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
