"""Qwen3-Omni code2wav as an omni Engine (engine name `qwen3_code2wav`): codec codes ->
24 kHz float32 waveform, streamed.

Request contract (omni.engines.streamed_vocoder): pieces of `tensors["codes"]` int64 [16, n]
(or [1, 16, n]); audio at 24000 Hz, 1920 samples per 80 ms frame.

Streaming is "tail-aware". The vocoder is causal, so a decode of frames [lo, end)
gives final samples up to end * 1920 - `lost` (the causal transposed convolutions
hold back `lost` samples, 555 for the real config, until the next frame arrives). Each
chunk decodes its new frames with `context_frames` (>= 1) frames of left context and emits
from the sample where the previous chunk stopped up to that tail, so the joined
chunks equal one whole decode (to ~1e-4 with 25 frames of context; the only error is
the attention's truncated history). transformers' `chunked_decode` (and vllm-omni)
instead cut at frame boundaries and lose `lost` samples at every chunk edge. A stream
decoded in one piece (final, nothing emitted yet, <= `max_frames`) is exactly a
whole decode. Streams whose next windows have the same length decode in one batch.
`stream: false` (vllm-omni's `async_chunk: false`) decodes each utterance whole once its last
codes are in: exactly transformers' decode, the first audio only at the end.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from omni.engines.streamed_vocoder import StreamedVocoder, VocoderStream, Window
from omni.models.qwen3_omni.weights import load_code2wav

logger = logging.getLogger(__name__)


class Qwen3Code2WavEngine(StreamedVocoder):
    name = "qwen3_code2wav"
    seconds_key = "code2wav_seconds"

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 first_chunk_frames: int = 4, chunk_frames: int = 25, context_frames: int = 25,
                 max_frames: int = 300, threads: int | None = None, max_num_seqs: int = 64,
                 stream: bool = True, parts: tuple | None = None):
        # context_frames >= 1: a chunk re-decodes the previous one's held-back tail (`lost` samples, less than a
        # frame) from its left context; with none it started `lost` samples before its window (checked below).
        if min(first_chunk_frames, chunk_frames, context_frames) < 1 or max_frames < chunk_frames:
            raise ValueError(f"need first_chunk_frames, chunk_frames, context_frames >= 1 and "
                             f"max_frames >= chunk_frames; got {first_chunk_frames}, {chunk_frames}, "
                             f"{context_frames}, {max_frames}")
        if threads:
            torch.set_num_threads(threads)
        # parts: (config, code2wav module) built in memory (benchmarks at real size); model_dir unused
        config, model = parts or load_code2wav(model_dir, dtype=dtype, device=device)
        super().__init__(device=device, groups=config.code2wav_config.num_quantizers,
                         vocab=config.code2wav_config.codebook_size, sample_rate=24000, max_num_seqs=max_num_seqs)
        self.config, self.model = config, model
        self.hop = int(self.model.total_upsample)
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.context_frames = context_frames
        self.max_frames = max_frames
        self.stream = stream
        self.lost = self._measure_lost()
        if stream and context_frames * self.hop < self.lost:
            raise ValueError(f"context_frames {context_frames}: a chunk must re-decode the previous one's last "
                             f"{self.lost} samples, so it needs at least {-(-self.lost // self.hop)} frames")

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

    def move_to(self, device: torch.device) -> None:
        self.model.to(device)

    # -- windows -------------------------------------------------------------------

    def ready(self, s: VocoderStream) -> bool:
        want = self.first_chunk_frames if s.done == 0 else self.chunk_frames
        return s.final or (self.stream and s.total - s.done >= want)

    def keep_from(self, s: VocoderStream) -> int:
        return max(0, s.done - self.context_frames) if self.stream else 0

    def window(self, s: VocoderStream) -> Window:
        end = min(s.total, s.done + self.max_frames) if self.stream else s.total
        lo = self.keep_from(s)
        return Window(lo, end, end, key=(end - lo,))

    def decode(self, batch: list[tuple[VocoderStream, Window]]) -> list[torch.Tensor]:
        wav = self.model(torch.stack([s.codes(w.lo, w.hi) for s, w in batch])).reshape(len(batch), -1)
        wav = wav.float().cpu()
        # Each window's final samples end `lost` before its end; emit from where the last chunk stopped.
        return [wav[i, s.samples - w.lo * self.hop:w.width * self.hop - self.lost].contiguous()
                for i, (s, w) in enumerate(batch)]
