"""The real Piper voice: split by two racing processes, then talker + code2wav
checked against the unsplit model."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave

import numpy as np
import pytest
import torch

from omni.audio import wav_bytes
from omni.engines.base import EngineError, EngineRequest, SamplingOverrides
from omni.models.piper.engines import Code2WavEngine, TalkerEngine, code2wav_request
from omni.engines.onnx_session import make_session
from omni.models.piper.voice import Phonemizer, VoicePaths, prepare_voice

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DETERMINISTIC = SamplingOverrides(noise_scale=0.0, noise_w_scale=0.0)
PREPARE = ("import sys; from omni.models.piper.voice import prepare_voice; "
           "print(prepare_voice('joe', cache_dir=sys.argv[1]).dir)")


@pytest.fixture(scope="module")
def voice(tmp_path_factory) -> VoicePaths:
    cache = tmp_path_factory.mktemp("voices")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE, str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            results.append((p.returncode, out.strip(), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rc, _, err in results:
        assert rc == 0, err
    assert results[0][1] == results[1][1] == str(cache / "joe")
    # Exactly one of the two did the split; the other found it done.
    assert sum("splitting" in err for _, _, err in results) == 1, [e for _, _, e in results]
    assert not [p for p in cache.iterdir() if p.name.startswith(".joe.tmp-")]
    paths = prepare_voice("joe", cache_dir=cache)      # fast path: marker present
    assert paths.sample_rate == 22050 and paths.hop_length == 256 and paths.latent_channels == 192
    return paths


@pytest.fixture(scope="module")
def talker(voice):
    return TalkerEngine(voice)


@pytest.fixture(scope="module")
def code2wav(voice):
    return Code2WavEngine(voice, chunk_frames=100_000)     # one-shot decode


def _drain(engine):
    outs = []
    while engine.has_unfinished():
        step = engine.step()
        assert step, "engine has unfinished work but produced nothing"
        outs += step
    return outs


def _speak(talker, code2wav, text, rid="r", **extra):
    talker.add_request(EngineRequest(request_id=rid, text=text, overrides=DETERMINISTIC, **extra))
    pieces = _drain(talker)
    assert pieces[-1].finished and all(p.error is None for p in pieces)
    for p in pieces:
        code2wav.add_request(code2wav_request(p))
    chunks = _drain(code2wav)
    assert chunks[-1].finished
    return pieces, np.concatenate([c.tensors["audio"].numpy() for c in chunks])


def test_split_equals_full_model(voice, talker, code2wav):
    text = "Chained stages must equal the whole model."
    (ids,) = Phonemizer(voice.config).sentences(text)
    full = make_session(voice.source)
    (ref,) = full.run(None, {"input": np.asarray([ids], np.int64),
                             "input_lengths": np.asarray([len(ids)], np.int64),
                             "scales": np.asarray([0.0, 1.0, 0.0], np.float32)})
    _, audio = _speak(talker, code2wav, text)
    ref = ref.reshape(-1)
    assert audio.shape == ref.shape
    assert np.abs(audio - ref).max() < 1e-5


def test_wav_duration_plausible_and_deterministic(talker, code2wav):
    text = "The quick brown fox jumps over the lazy dog."
    pieces, audio = _speak(talker, code2wav, text)
    _, again = _speak(talker, code2wav, text)
    np.testing.assert_array_equal(audio, again)
    data = wav_bytes(audio, code2wav.sample_rate)
    with wave.open(io.BytesIO(data)) as w:
        seconds = w.getnframes() / w.getframerate()
        assert w.getframerate() == 22050
    words = len(text.split())
    assert 0.3 * words <= seconds <= 1.5 * words, seconds
    assert np.abs(audio).max() > 0.05                  # not silence
    frames = sum(p.tensors["latents"].shape[2] for p in pieces)
    _, fast = _speak(talker, code2wav, text, speed=2.0)
    assert 0.35 * len(audio) < len(fast) < 0.65 * len(audio)   # speed halves durations
    assert frames * 256 == len(audio)


def test_streaming_matches_one_shot(voice, talker, code2wav):
    text = "Streaming starts early. It must still sound the same, chunk after chunk!"
    pieces, ref = _speak(talker, code2wav, text)
    assert len(pieces) == 2                            # one talker output per sentence
    stream = Code2WavEngine(voice, chunk_frames=24, first_chunk_frames=8, context_frames=16)
    chunks = []
    for p in pieces:
        stream.add_request(code2wav_request(p))
        while stream.has_ready_work():
            chunks += stream.step()
    assert not stream.has_open_streams() and chunks[-1].finished
    assert len(chunks) > 4
    joined = np.concatenate([c.tensors["audio"].numpy() for c in chunks])
    assert joined.shape == ref.shape
    assert np.abs(joined - ref).max() < 1e-4


def test_bad_input_then_still_works(talker, code2wav):
    with pytest.raises(EngineError, match="unknown voice 'amy'"):
        talker.add_request(EngineRequest(request_id="bad", text="hi", voice="amy"))
    with pytest.raises(EngineError, match="empty text"):
        talker.add_request(EngineRequest(request_id="bad", text=" \n"))
    with pytest.raises(EngineError, match=r"latents must be \[1, 192, T\]"):
        code2wav.add_request(EngineRequest(request_id="bad", tensors={"latents": torch.zeros(1, 80, 10)}))
    _, audio = _speak(talker, code2wav, "Still here.")
    assert len(audio) > 0.3 * 22050
