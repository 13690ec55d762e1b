"""omni/api/speech._chunks, the one generator of a speech stream's chunks (raw and SSE): which audio events
become chunks, what an encoder holds back, its tail, and its close however the stream ends."""

from contextlib import aclosing

import pytest

from omni.api.errors import APIError
from omni.api.speech import _chunks, _started

pytestmark = pytest.mark.anyio


class FakeGen:
    def __init__(self, events, fail: Exception | None = None, rate: int = 24000):
        self._events, self._fail, self.first_sample_rate, self.closed = events, fail, rate, False

    async def start(self):
        pass

    async def close(self):
        self.closed = True

    async def events(self):
        for ev in self._events:
            yield ev
        if self._fail is not None:
            raise self._fail


class FakeEncoder:
    """Holds back its first write (an encoder's frame), returns the others tagged; a tail at close."""

    def __init__(self):
        self.writes, self.closes = [], 0

    def write(self, pcm: bytes) -> bytes:
        self.writes.append(pcm)
        return b"" if len(self.writes) == 1 else b"enc:" + pcm

    def close(self) -> bytes:
        self.closes += 1
        return b"tail" if self.closes == 1 else b""


EVENTS = [("audio", b"a"), ("text", "hi"), ("audio", b""), ("audio", b"b")]


def plain(pcm: bytes) -> bytes:
    return b"<" + pcm + b">" if pcm else b""


async def _all(gen, enc, raw):
    return [c async for c in _chunks(gen, enc, plain, raw=raw)]


async def test_raw_passes_an_empty_audio_chunk_on_and_sse_skips_it():
    assert await _all(FakeGen(EVENTS), None, raw=True) == [b"<a>", b"", b"<b>"]
    assert await _all(FakeGen(EVENTS), None, raw=False) == [b"<a>", b"<b>"]


async def test_an_encoders_held_back_bytes_are_not_a_chunk_and_its_tail_is_the_last():
    enc = FakeEncoder()
    assert await _all(FakeGen(EVENTS), enc, raw=True) == [b"enc:", b"enc:b", b"tail"]
    assert enc.writes == [b"a", b"", b"b"] and enc.closes == 2     # the raw form writes the empty chunk too
    enc = FakeEncoder()
    assert await _all(FakeGen(EVENTS), enc, raw=False) == [b"enc:b", b"tail"]
    assert enc.writes == [b"a", b"b"]


async def test_the_encoder_is_closed_when_the_pipeline_fails_or_the_stream_is_closed_early():
    enc = FakeEncoder()
    with pytest.raises(RuntimeError, match="gone"):
        await _all(FakeGen(EVENTS, fail=RuntimeError("gone")), enc, raw=False)
    assert enc.closes == 1
    enc = FakeEncoder()
    async with aclosing(_chunks(FakeGen([("audio", b"a"), ("audio", b"b"), ("audio", b"c")]), enc, plain,
                                raw=True)) as chunks:
        assert await anext(chunks) == b"enc:b"
    assert enc.closes == 1 and enc.writes == [b"a", b"b"]


async def test_a_stream_that_ends_without_audio_is_a_500_and_its_generation_closed():
    gen = FakeGen([], rate=0)
    with pytest.raises(APIError) as e:
        await _started(gen)
    assert e.value.status == 500 and gen.closed
    gen = FakeGen([])
    await _started(gen)
    assert not gen.closed
