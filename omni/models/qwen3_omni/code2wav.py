"""Qwen3-Omni code2wav as an omni Engine (engine name `qwen3_code2wav`): codec codes ->
24 kHz float32 waveform, streamed.

Request contract: one continuing request, pieces with the same request_id carrying
`tensors["codes"]` int64 [16, n] (or [1, 16, n]); `final` (default True)
marks the last piece (it may carry no codes). Output: `tensors["audio"]` float32 1-D
chunks at `Qwen3Code2WavEngine.sample_rate` (24000 Hz, from the checkpoint: 1920
samples per 80 ms frame); finished on the last.

Streaming is "tail-aware". The vocoder is causal, so a decode of frames [lo, end)
gives final samples up to end * 1920 - `lost` (the causal transposed convolutions
hold back `lost` samples, 555 for the real config, until the next frame arrives). Each
chunk decodes its new frames with `context_frames` frames of left context and emits
from the sample where the previous chunk stopped up to that tail, so the joined
chunks equal one whole decode (to ~1e-4 with 25 frames of context; the only error is
the attention's truncated history). transformers' `chunked_decode` (and vllm-omni)
instead cut at frame boundaries and lose `lost` samples at every chunk edge. A stream
decoded in one piece (final, nothing emitted yet, <= `max_frames`) is exactly a
whole decode. Streams whose next windows have the same length decode in one batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from pathlib import Path

import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from omni.models.qwen3_omni.weights import load_code2wav

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stream:
    rid: str
    buf: torch.Tensor             # [G, n] codes from absolute frame `start`
    start: int = 0
    total: int = 0                # frames received
    done_frames: int = 0          # frames whose final samples have been emitted
    samples: int = 0              # samples emitted
    final: bool = False


class Qwen3Code2WavEngine(Engine):
    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 first_chunk_frames: int = 4, chunk_frames: int = 25, context_frames: int = 25,
                 max_frames: int = 300, threads: int | None = None, max_num_seqs: int = 64,
                 parts: tuple | None = None):
        if min(first_chunk_frames, chunk_frames) < 1 or context_frames < 0 or max_frames < chunk_frames:
            raise ValueError(f"need first_chunk_frames, chunk_frames >= 1, context_frames >= 0 and "
                             f"max_frames >= chunk_frames; got {first_chunk_frames}, {chunk_frames}, "
                             f"{context_frames}, {max_frames}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs     # streams decoded in one batch
        if threads:
            torch.set_num_threads(threads)
        # parts: (config, code2wav module) built in memory (benchmarks at real size); model_dir unused
        self.config, self.model = parts or load_code2wav(model_dir, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.groups = self.config.code2wav_config.num_quantizers
        self.codebook = self.config.code2wav_config.codebook_size
        self.hop = int(self.model.total_upsample)
        self.sample_rate = 24000
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.context_frames = context_frames
        self.max_frames = max_frames
        self.lost = self._measure_lost()
        self._streams: collections.OrderedDict[str, _Stream] = collections.OrderedDict()
        self._stats: collections.Counter = collections.Counter()
        self._sleeping = False

    @torch.no_grad()
    def _measure_lost(self) -> int:
        """Samples a decode of n frames holds back at its end (n * hop - length), the same for any n."""
        lost = set()
        for n in (2, 3):
            wav = self.model(torch.zeros((1, self.groups, n), dtype=torch.long, device=self.device))
            lost.add(n * self.hop - wav.shape[-1])
        if len(lost) != 1:
            raise RuntimeError(f"code2wav tail is not a constant number of samples: {sorted(lost)}")
        return lost.pop()

    # -- requests ------------------------------------------------------------

    def _codes(self, req: EngineRequest) -> torch.Tensor | None:
        t = (req.tensors or {}).get("codes")
        if t is None:
            return None
        t = torch.as_tensor(t)
        if t.ndim == 3 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 2 or t.shape[0] != self.groups:
            raise EngineError(f"request {req.request_id}: codes must be int64 [{self.groups}, n], "
                              f"got shape {list(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise EngineError(f"request {req.request_id}: codes must be integers, got {t.dtype}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.codebook):
            raise EngineError(f"request {req.request_id}: codes must lie in [0, {self.codebook}), "
                              f"got [{int(t.min())}, {int(t.max())}]")
        return t.to(self.device, torch.long)

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self._sleeping:
            raise EngineError(f"request {rid}: qwen3_code2wav is asleep (wake_up first)")
        final = request.final
        codes = self._codes(request)
        s = self._streams.get(rid)
        if s is not None and s.final:
            raise EngineError(f"request {rid}: codes after the piece marked final")
        if codes is None and not final:
            raise EngineError(f"request {rid}: no 'codes' tensor (only a final piece may omit it)")
        if s is None:
            s = self._streams[rid] = _Stream(rid, torch.zeros((self.groups, 0), dtype=torch.long,
                                                               device=self.device))
        if codes is not None and codes.shape[1]:
            s.buf = torch.cat([s.buf, codes], dim=1)
            s.total += codes.shape[1]
        s.final = final

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- work ------------------------------------------------------------------

    def _ready(self, s: _Stream) -> bool:
        if s.final:
            return True
        want = self.first_chunk_frames if s.done_frames == 0 else self.chunk_frames
        return s.total - s.done_frames >= want

    def _window(self, s: _Stream) -> tuple[int, int]:
        end = min(s.total, s.done_frames + self.max_frames)
        lo = max(0, s.done_frames - self.context_frames)
        return lo, end

    def _width(self, s: _Stream) -> int:
        lo, end = self._window(s)
        return end - lo

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if self._sleeping:
            return []
        ready = [s for s in self._streams.values() if self._ready(s)]
        if not ready:
            return []
        # One batch: the first ready stream and every other whose window has the same length.
        width = self._width(ready[0])
        batch = [s for s in ready if self._width(s) == width][:self.max_num_seqs]
        outs = []
        audio: list[torch.Tensor] = []
        if width > 0:
            windows = []
            for s in batch:
                lo, end = self._window(s)
                windows.append(s.buf[:, lo - s.start:end - s.start])
            t0 = time.perf_counter()
            wav = self.model(torch.stack(windows)).reshape(len(batch), -1).float()
            self._stats["code2wav_seconds"] += time.perf_counter() - t0
            self._stats["batched"] += len(batch) > 1
            for i, s in enumerate(batch):
                lo, end = self._window(s)
                stop = (end - lo) * self.hop - self.lost     # = wav.shape[1]: the final samples
                audio.append(wav[i, s.samples - lo * self.hop:stop].contiguous())
                s.samples = lo * self.hop + stop
                s.done_frames = end
                self._stats["frames_decoded"] += end - lo
        else:
            audio = [torch.zeros(0) for _ in batch]
        for s, a in zip(batch, audio):
            self._stats["samples"] += a.shape[0]
            done = s.final and s.done_frames == s.total
            keep = max(s.start, s.done_frames - self.context_frames)   # the next window's left context
            s.buf, s.start = s.buf[:, keep - s.start:], keep
            if done:
                del self._streams[s.rid]
            else:
                self._streams.move_to_end(s.rid)   # round-robin
            outs.append(EngineOutput(request_id=s.rid, tensors={"audio": a.cpu()}, finished=done,
                                     sample_rate=self.sample_rate,
                                     finish_reason="stop" if done else None))
        return outs

    # -- bookkeeping -------------------------------------------------------------

    def has_unfinished(self) -> bool:
        # Only streams a step can advance (the stage loop spins while this is true).
        return not self._sleeping and any(self._ready(s) for s in self._streams.values())

    def has_open_streams(self) -> bool:
        return bool(self._streams)

    def num_waiting(self) -> int:
        return sum(1 for s in self._streams.values() if not self._ready(s))

    def num_running(self) -> int:
        return sum(1 for s in self._streams.values() if self._ready(s))

    def can_sleep(self) -> bool:
        return self.device.type != "cpu"

    def sleep(self, level: int = 1) -> None:
        if not self.can_sleep():
            raise EngineError("qwen3_code2wav on CPU cannot sleep: its weights have no device memory to free")
        if self._streams:
            raise EngineError(f"qwen3_code2wav cannot sleep with {len(self._streams)} stream(s) open")
        self.model.to("cpu")
        self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self.model.to(self.device)
            self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        if out.get("samples"):
            out["rtf"] = out.get("code2wav_seconds", 0.0) / (out["samples"] / self.sample_rate)
        return out
