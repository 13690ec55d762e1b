"""The audio stages on onnxruntime: talker (text -> latent frames) and code2wav
(latent frames -> waveform), built from a voice split by omni.models.piper.voice.

Both engines do one unit of work per `step()` and serve requests round-robin:
the talker synthesises one sentence of one request, code2wav decodes one chunk
of one stream. VITS graphs take one utterance at a time, and a step that stays
short keeps the stage loop responsive; batching several requests would mean
padding and masking that the exported graph does not do.

Wire contract between the two (see `code2wav_request`):
  talker output   tensors={"latents": float32 [1, C, T]}, one output per
                  sentence, finished=True on the last one;
  code2wav input  the same request_id for every piece, tensors={"latents": ...},
                  final (default True: a one-shot request);
  code2wav output tensors={"audio": float32 [n]} per chunk, finished on the last.
Code2WavEngine.has_unfinished() is true only while a step can make progress;
a stream waiting for its next piece counts in num_waiting()/has_open_streams().
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time

import numpy as np
import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest, StreamEngine
from omni.engines.onnx_session import make_session
from omni.models.piper.voice import LATENT_NAME, Phonemizer, VoicePaths

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 20_000


def _voice_paths(voice: str | os.PathLike | VoicePaths) -> VoicePaths:
    return voice if isinstance(voice, VoicePaths) else VoicePaths.from_dir(voice)


def _number(value: float | None, key: str, default: float, lo: float, hi: float,
            request_id: str) -> float:
    if value is None:
        return default
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise EngineError(f"request {request_id}: {key} must be a number, got {value!r}") from None
    if not (math.isfinite(f) and lo <= f <= hi):
        raise EngineError(f"request {request_id}: {key}={value!r} is outside [{lo}, {hi}]")
    return f


@dataclasses.dataclass
class _TalkJob:
    request_id: str
    sentences: list[list[int]]
    scales: np.ndarray
    next: int = 0


class TalkerEngine(Engine):
    """Text -> latent frames [1, C, T], one output per sentence."""

    def __init__(self, voice_dir: str | os.PathLike | VoicePaths, *, threads: int = 1,
                 max_text_chars: int = MAX_TEXT_CHARS):
        self.paths = _voice_paths(voice_dir)
        self.voice = self.paths.name
        self.sample_rate = self.paths.sample_rate
        self.frames_per_second = self.paths.sample_rate / self.paths.hop_length
        self.max_text_chars = max_text_chars
        self._phonemizer = Phonemizer(self.paths.config)
        cfg = self._phonemizer.config
        if cfg.num_speakers > 1:
            raise EngineError(f"voice {self.voice!r}: multi-speaker voices are not supported yet")
        self._defaults = (cfg.noise_scale, cfg.length_scale, cfg.noise_w_scale)
        self._session = make_session(self.paths.talker, threads)
        self._queue: collections.deque[_TalkJob] = collections.deque()
        self._jobs: dict[str, _TalkJob] = {}
        self._held: dict[str, tuple[float, _TalkJob]] = {}   # request id -> (hold deadline, job)
        self._stats = collections.Counter()

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self._jobs:
            raise EngineError(f"request {rid}: already running")
        voice = request.voice or self.voice
        if voice != self.voice:
            raise EngineError(f"request {rid}: unknown voice {voice!r}; this talker serves {self.voice!r}")
        text = request.text
        if text is None or not text.strip():
            raise EngineError(f"request {rid}: empty text")
        if len(text) > self.max_text_chars:
            raise EngineError(f"request {rid}: text has {len(text)} characters, "
                              f"the limit is {self.max_text_chars}")
        noise, length, noise_w = self._defaults
        speed = _number(request.speed, "speed", 1.0, 0.1, 10.0, rid)
        own = request.overrides
        scales = np.array([
            _number(own.noise_scale, "noise_scale", noise, 0.0, 2.0, rid),
            length / speed,      # speed 2 = half the phoneme durations
            _number(own.noise_w_scale, "noise_w_scale", noise_w, 0.0, 2.0, rid),
        ], dtype=np.float32)
        sentences = self._phonemizer.sentences(text)
        # An upstream stage's sentence ("...", the orchestrator names it rid/sub_id) with nothing to
        # speak is zero audio, finished normally; the client's own text (/v1/audio/speech) is a 400.
        if not sentences and "/" not in rid:
            raise EngineError(f"request {rid}: nothing to speak in text {text[:40]!r}")
        job = _TalkJob(rid, sentences, scales)
        self._jobs[rid] = job
        self._queue.append(job)

    def abort(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is not None and self._held.pop(request_id, None) is None:
            self._queue.remove(job)

    # A held request's next sentence waits (until a deadline or release()) while code2wav
    # makes its first audio: on a few shared cores the two would split the CPU.
    def can_hold(self) -> bool:
        return True

    def hold(self, request_id: str, until: float) -> None:
        job = self._jobs.get(request_id)
        if job is not None and request_id not in self._held:
            self._queue.remove(job)
            self._held[request_id] = (until, job)

    def release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._queue.append(held[1])

    def held_until(self) -> float | None:
        return min(until for until, _ in self._held.values()) if self._held else None

    def _release_due(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (until, _) in self._held.items() if until <= now]:
            self.release(rid)

    def step(self) -> list[EngineOutput]:
        if self._held:
            self._release_due()
        if not self._queue:
            return []
        job = self._queue.popleft()
        if not job.sentences:
            del self._jobs[job.request_id]
            return [EngineOutput(request_id=job.request_id, finished=True, finish_reason="stop", num_prompt_tokens=0)]
        ids = job.sentences[job.next]
        try:
            t0 = time.perf_counter()
            (latents,) = self._session.run(None, {
                "input": np.asarray([ids], dtype=np.int64),
                "input_lengths": np.asarray([len(ids)], dtype=np.int64),
                "scales": job.scales,
            })
            self._stats["talker_seconds"] += time.perf_counter() - t0
        except Exception as e:   # a request's failure is its result; the loop lives
            logger.warning("talker request %s failed: %s", job.request_id, e)
            del self._jobs[job.request_id]
            return [EngineOutput(request_id=job.request_id, finished=True, finish_reason="error",
                                 error=f"talker: {type(e).__name__}: {e}")]
        self._stats["frames"] += latents.shape[2]
        first = job.next == 0
        job.next += 1
        done = job.next == len(job.sentences)
        if done:
            del self._jobs[job.request_id]
        else:
            self._queue.append(job)
        return [EngineOutput(
            request_id=job.request_id,
            tensors={"latents": torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))},
            finished=done, finish_reason="stop" if done else None,
            num_prompt_tokens=sum(len(s) for s in job.sentences) if first else None)]

    def has_unfinished(self) -> bool:
        """True while step() has work now (a held request waits for `held_until()`)."""
        return bool(self._queue) or (bool(self._held) and self.held_until() <= time.monotonic())

    def num_waiting(self) -> int:
        return sum(1 for j in self._queue if j.next == 0)

    def num_running(self) -> int:
        return sum(1 for j in self._queue if j.next > 0) + len(self._held)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


@dataclasses.dataclass
class _Stream:
    request_id: str
    buf: np.ndarray          # [C, n] frames from absolute index `start`
    start: int = 0
    total: int = 0           # frames received so far
    emitted: int = 0         # frames whose audio has gone out
    final: bool = False


class Code2WavEngine(StreamEngine):
    """Latent frames -> waveform chunks, streaming with context on both sides.

    A chunk of `chunk_frames` frames is decoded together with up to
    `context_frames` frames before and after it, and only the chunk's own
    samples are kept, so the joined chunks match a one-shot decode closely.
    A chunk waits until its right context has arrived (or the stream is final).
    The first chunk may be smaller (`first_chunk_frames`) for an earlier start.
    """

    def __init__(self, voice_dir: str | os.PathLike | VoicePaths, *, chunk_frames: int = 64,
                 context_frames: int = 16, first_chunk_frames: int | None = None,
                 threads: int = 1):
        if chunk_frames < 1 or context_frames < 0:
            raise ValueError(f"chunk_frames must be >= 1 and context_frames >= 0, "
                             f"got {chunk_frames} and {context_frames}")
        self.paths = _voice_paths(voice_dir)
        self.sample_rate = self.paths.sample_rate
        self.hop_length = self.paths.hop_length
        self.channels = self.paths.latent_channels
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames or chunk_frames
        self.context_frames = context_frames
        self._session = make_session(self.paths.code2wav, threads)
        self._streams: collections.OrderedDict[str, _Stream] = collections.OrderedDict()
        self._stats = collections.Counter()

    # -- requests ------------------------------------------------------------

    def _latents(self, request: EngineRequest) -> np.ndarray | None:
        t = (request.tensors or {}).get("latents")
        if t is None:
            return None
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().numpy()
        a = np.asarray(t)
        if a.ndim == 3 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 2 or a.shape[0] != self.channels:
            raise EngineError(f"request {request.request_id}: latents must be [1, {self.channels}, T], "
                              f"got shape {list(np.shape(t))}")
        if a.dtype.kind != "f":
            raise EngineError(f"request {request.request_id}: latents must be floating point, got {a.dtype}")
        a = a.astype(np.float32, copy=False)
        if not np.isfinite(a).all():
            raise EngineError(f"request {request.request_id}: latents contain NaN or infinity")
        return a

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        final = request.final
        latents = self._latents(request)
        stream = self._streams.get(rid)
        if stream is not None and stream.final:
            raise EngineError(f"request {rid}: latents after the piece marked final")
        if latents is None and not final:
            raise EngineError(f"request {rid}: no 'latents' tensor (only a final piece may omit it)")
        if stream is None:
            stream = _Stream(rid, np.zeros((self.channels, 0), np.float32))
            self._streams[rid] = stream
        if latents is not None and latents.shape[1]:
            stream.buf = np.concatenate([stream.buf, latents], axis=1)
            stream.total += latents.shape[1]
        stream.final = final

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- work ------------------------------------------------------------------

    def _ready(self, s: _Stream) -> bool:
        if s.final:
            return True     # flush what is left, or send the empty last chunk
        n = self.first_chunk_frames if s.emitted == 0 else self.chunk_frames
        return s.total >= s.emitted + n + self.context_frames

    def has_ready_work(self) -> bool:
        """True when step() would produce output."""
        return self.has_unfinished()

    def step(self) -> list[EngineOutput]:
        stream = next((s for s in self._streams.values() if self._ready(s)), None)
        if stream is None:
            return []
        self._streams.move_to_end(stream.request_id)   # round-robin
        try:
            audio = self._decode_next(stream)
        except Exception as e:   # a request's failure is its result; the loop lives
            logger.warning("code2wav request %s failed: %s", stream.request_id, e)
            del self._streams[stream.request_id]
            return [EngineOutput(request_id=stream.request_id, finished=True, finish_reason="error",
                                 error=f"code2wav: {type(e).__name__}: {e}")]
        done = stream.final and stream.emitted == stream.total
        if done:
            del self._streams[stream.request_id]
        return [EngineOutput(request_id=stream.request_id, tensors={"audio": torch.from_numpy(audio)},
                             finished=done, finish_reason="stop" if done else None, sample_rate=self.sample_rate)]

    def _decode_next(self, s: _Stream) -> np.ndarray:
        n = self.first_chunk_frames if s.emitted == 0 else self.chunk_frames
        begin = s.emitted
        end = min(begin + n, s.total)
        if end == begin:
            return np.zeros(0, np.float32)
        lo = max(s.start, begin - self.context_frames)
        hi = min(s.total, end + self.context_frames)
        window = s.buf[None, :, lo - s.start:hi - s.start]
        t0 = time.perf_counter()
        (wave,) = self._session.run(None, {LATENT_NAME: np.ascontiguousarray(window)})
        self._stats["code2wav_seconds"] += time.perf_counter() - t0
        self._stats["frames_decoded"] += hi - lo
        self._stats["frames_emitted"] += end - begin
        wave = wave.reshape(-1)
        hop = self.hop_length
        audio = np.array(wave[(begin - lo) * hop:(end - lo) * hop], dtype=np.float32)
        s.emitted = end
        # Forget frames no later chunk can need as left context.
        keep_from = max(s.start, s.emitted - self.context_frames)
        s.buf = s.buf[:, keep_from - s.start:]
        s.start = keep_from
        return audio

    def open_requests(self):
        return self._streams.values()

    def is_ready(self, s: _Stream) -> bool:
        return self._ready(s)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


def code2wav_request(talker_output: EngineOutput, request_id: str | None = None) -> EngineRequest:
    """The code2wav piece for one talker output: same latents, final on the last."""
    if talker_output.error is not None:
        raise EngineError(f"request {talker_output.request_id}: talker failed: {talker_output.error}")
    tensors = {}
    if "latents" in talker_output.tensors:
        tensors["latents"] = talker_output.tensors["latents"]
    return EngineRequest(request_id=request_id or talker_output.request_id, tensors=tensors,
                         final=bool(talker_output.finished))
