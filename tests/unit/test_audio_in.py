"""Audio input: WAV decoding (every common encoding), resampling, and the inline tensor on the wire."""

import io
import struct
import tracemalloc
import wave

import numpy as np
import pytest
import torch

from omni import audio
from omni.stage import messages as m


def pcm_wav(samples: np.ndarray, rate: int, width: int, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 1:
            data = (np.clip(samples, -1, 1) * 127 + 128).astype(np.uint8).tobytes()
        elif width == 3:
            v = (np.clip(samples, -1, 1) * (2 ** 23 - 1)).astype(np.int32)
            data = b"".join(int(x).to_bytes(3, "little", signed=True) for x in v)
        else:
            data = (np.clip(samples, -1, 1) * (2 ** (8 * width - 1) - 1)).astype(f"<i{width}").tobytes()
        w.writeframes(data)
    return buf.getvalue()


def float_wav(samples: np.ndarray, rate: int, extensible: bool = False) -> bytes:
    data = samples.astype("<f4").tobytes()
    if extensible:
        fmt = struct.pack("<HHIIHHHHIH14s", 0xFFFE, 1, rate, rate * 4, 4, 32, 22, 32, 0, 3, b"\x00" * 14)
    else:
        fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00" \
        + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


SIG = (0.5 * np.sin(2 * np.pi * 440 * np.arange(800) / 16000)).astype(np.float32)


@pytest.mark.parametrize("width, tol", [(1, 2e-2), (2, 1e-4), (3, 1e-6), (4, 1e-8)])
def test_integer_pcm_of_every_width_decodes(width, tol):
    got, rate = audio.read_wav(pcm_wav(SIG, 16000, width))
    assert rate == 16000 and got.dtype == np.float32 and np.abs(got - SIG).max() < tol


def test_float_wav_is_exact_and_odd_chunks_are_skipped():
    for extensible in (False, True):
        got, rate = audio.read_wav(float_wav(SIG, 22050, extensible))
        assert rate == 22050 and np.array_equal(got, SIG)


def test_stereo_is_averaged_to_mono():
    left_right = np.stack([SIG, np.zeros_like(SIG)], axis=1).reshape(-1)
    got, _ = audio.read_wav(pcm_wav(left_right, 16000, 2, channels=2))
    assert np.abs(got - SIG / 2).max() < 1e-4


@pytest.mark.parametrize("data, words", [
    (b"not a wav at all", "no RIFF/WAVE header"),
    (b"RIFF\x04\x00\x00\x00WAVE", "no data chunk"),
    (b"RIFF\x10\x00\x00\x00WAVEdata\x00\x00\x00\x00", "before its fmt"),
    (pcm_wav(SIG, 16000, 2).replace(b"\x01\x00\x01\x00", b"\x02\x00\x01\x00", 1), "format tag 2"),
])
def test_broken_files_name_the_problem(data, words):
    with pytest.raises(ValueError, match=words):
        audio.read_wav(data)


def test_resampling_keeps_a_tone_below_the_new_nyquist():
    rate_in = 44100
    t = np.arange(rate_in // 2) / rate_in
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    y = audio.resample(x, rate_in, 16000)
    assert y.size == 8000
    want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)
    assert np.abs(y[200:-200] - want[200:-200]).max() < 1e-3      # away from the edges
    assert audio.resample(x, 16000, 16000) is not None and np.array_equal(audio.resample(x, 1, 1), x)


def test_resampling_removes_what_the_new_rate_cannot_hold():
    t = np.arange(48000) / 48000
    x = np.sin(2 * np.pi * 12000 * t).astype(np.float32)        # above 8 kHz, the Nyquist of 16 kHz
    assert np.abs(audio.resample(x, 48000, 16000)[200:-200]).max() < 0.05


def test_inline_tensor_round_trips_through_the_stage_codec():
    t = m.InlineTensor("float32", (3,), np.array([1.5, -2.0, 0.25], "<f4").tobytes())
    msg = m.AddRequest(request_id="r", inline={"audio_0": t})
    back = m.stage_codec().decode(m.stage_codec().encode(msg))
    assert torch.equal(m.inline_tensor(back.inline["audio_0"]), torch.tensor([1.5, -2.0, 0.25]))
    with pytest.raises(ValueError, match="needs 12 bytes"):
        m.inline_tensor(m.InlineTensor("float32", (3,), b"\x00" * 8))
    with pytest.raises(ValueError, match="not a torch dtype"):
        m.inline_tensor(m.InlineTensor("nonsense", (1,), b"\x00"))


def with_rate(data: bytes, rate: int) -> bytes:
    return data[:24] + struct.pack("<I", rate) + data[28:]      # the fmt chunk's sample rate


@pytest.mark.parametrize("rate", [0xFFFFFFFF, 384001, 999])
def test_a_sample_rate_outside_the_taken_range_is_refused_naming_it(rate):
    with pytest.raises(ValueError, match=f"sample rate {rate} Hz is outside"):
        audio.read_wav(with_rate(pcm_wav(SIG, 16000, 1), rate))
    with pytest.raises(ValueError, match=f"{rate} Hz"):      # the resampler's own guard
        audio.resample(np.zeros(1000, np.float32), rate, 16000)
    for ok in (1000, 384000):
        assert audio.read_wav(with_rate(pcm_wav(SIG, 16000, 1), ok))[1] == ok


def test_resampling_from_the_highest_rate_works_in_bounded_blocks():
    rate_in = 384000
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(rate_in) / rate_in)).astype(np.float32)
    tracemalloc.start()     # numpy reports its buffers to it
    try:
        y = audio.resample(x, rate_in, 16000)       # 792 taps per output sample
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, f"{peak >> 20} MiB"    # 16384-row blocks took 580 MiB
    want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert y.size == 16000 and np.abs(y[400:-400] - want[400:-400]).max() < 1e-3


def direct_resample(x: np.ndarray, rate_in: int, rate_out: int, half_taps: int = 16) -> np.ndarray:
    """The same filter evaluated at each output instant (what resample did, seconds a minute of audio)."""
    ratio = rate_out / rate_in
    cutoff = min(1.0, ratio) * 0.97
    width = int(np.ceil(half_taps / cutoff))
    offs = np.arange(-width + 1, width + 1)
    t = np.arange(int(round(x.size * ratio))) / ratio
    idx = np.floor(t).astype(np.int64)[:, None] + offs[None, :]
    d = t[:, None] - idx
    w = cutoff * np.sinc(cutoff * d) * (0.5 + 0.5 * np.cos(np.pi * np.clip(d / width, -1.0, 1.0)))
    taps = np.where((idx >= 0) & (idx < x.size), x[np.clip(idx, 0, x.size - 1)], 0.0)
    return (taps * w).sum(axis=1).astype(np.float32)


@pytest.mark.parametrize("rate_in, rate_out", [(44100, 16000), (1000, 16000), (8000, 16000), (22050, 16000),
                                               (16001, 16000), (384000, 16000), (383999, 16000), (16000, 44100)])
def test_polyphase_resampling_equals_the_filter_evaluated_directly(rate_in, rate_out):
    x = (0.3 * np.random.default_rng(rate_in).standard_normal(rate_in // 8 + 7)).astype(np.float32)
    y = audio.resample(x, rate_in, rate_out)
    want = direct_resample(x, rate_in, rate_out)
    assert y.shape == want.shape and np.abs(y - want).max() < 1e-5


def test_upsampling_keeps_a_pure_tone_at_its_frequency():
    x = (0.5 * np.sin(2 * np.pi * 300 * np.arange(2000) / 1000)).astype(np.float32)   # 2 s of 300 Hz at 1 kHz
    y = audio.resample(x, 1000, 16000)
    spectrum = np.abs(np.fft.rfft(y[1600:-1600] * np.hanning(y.size - 3200)))
    peak = np.fft.rfftfreq(y.size - 3200, 1 / 16000)[spectrum.argmax()]
    assert abs(peak - 300) < 1 and spectrum[np.fft.rfftfreq(y.size - 3200, 1 / 16000) > 600].max() < 1e-3 * spectrum.max()
    want = 0.5 * np.sin(2 * np.pi * 300 * np.arange(y.size) / 16000)
    assert np.abs(y[800:-800] - want[800:-800]).max() < 2e-2


def count_sinc(monkeypatch) -> list[int]:
    evaluated = []
    sinc = np.sinc
    monkeypatch.setattr(audio.np, "sinc", lambda v: evaluated.append(np.size(v)) or sinc(v))
    audio._phase_weights.cache_clear()
    return evaluated


def test_resampling_evaluates_the_filter_once_per_phase_not_per_output_sample(monkeypatch):
    """A 600 s 8-bit 1 kHz WAV is 600 KB; evaluating the sinc at each of its 9.6 M outputs' taps took 21 s of the
    frontend's tokenizer thread. 1 kHz -> 16 kHz has 16 phases of 34 taps: the filter is evaluated at 16 x 34
    points, whatever the length (counted, not timed: speed figures belong in benchmarks)."""
    evaluated = count_sinc(monkeypatch)
    x = np.zeros(600 * 1000, np.float32)
    x[::97] = 0.5
    y = audio.resample(x, 1000, 16000)
    assert y.size == 600 * 16000 and evaluated == [16 * 34]


@pytest.mark.parametrize("rate_in, seconds", [(1001, 1), (16001, 1), (1001, 10), (383999, 1)])
def test_coprime_rates_evaluate_many_phases_per_numpy_call(monkeypatch, rate_in, seconds):
    """1001 Hz -> 16 kHz has 16000 phases, about one per output of a one-second part: a Python step per phase
    (a sinc call of 34 points each) cost 0.2 s of the tokenizer thread a part, 900 such parts 3 minutes.
    Phases go to numpy by the block: a handful of calls, and no more points than the outputs' taps."""
    evaluated = count_sinc(monkeypatch)
    x = (0.3 * np.random.default_rng(rate_in).standard_normal(rate_in * seconds)).astype(np.float32)
    y = audio.resample(x, rate_in, 16000)
    taps = 2 * int(np.ceil(16 / (min(1.0, 16000 / rate_in) * 0.97)))
    assert y.size == 16000 * seconds
    assert len(evaluated) <= 1 + 16000 * taps // audio.BLOCK_ELEMS, len(evaluated)     # 15984 calls before
    assert sum(evaluated) <= min(16000, y.size) * taps
    if seconds == 1 and rate_in < 20000:      # 383999 Hz is compared on a shorter input above
        assert np.abs(y - direct_resample(x, rate_in, 16000)).max() < 1e-5
    if rate_in < 20000:     # the next part at these rates reuses the weights (one table, 2 MiB)
        evaluated.clear()
        assert np.array_equal(audio.resample(x, rate_in, 16000), y) and evaluated == []
