"""What every streamed vocoder engine shares: codec codes in, audio chunks out.

Request contract: one continuing request per utterance, pieces with the same request_id carrying
`tensors["codes"]` int64 [groups, n] (a leading batch of 1, or for one group a flat [n], is
accepted); the piece marked `final` (EngineRequest.final, default true) may carry no codes. Output:
`tensors["audio"]` float32 1-D chunks at `sample_rate`, finished on the last.

A subclass says when a stream is ready (`ready`), which codes its next decode reads and up to
which code it emits audio (`window`), and decodes a batch of such windows (`decode`); this base
keeps the streams (codes from the first one a later window can read, the emitted-code and
emitted-sample cursors), batches ready streams whose windows have equal `key`s, assembles the
outputs, drops what no later window reads, and moves the weights off the device while asleep.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import time

import torch

from omni.engines.base import EngineError, EngineOutput, EngineRequest, StreamEngine
from omni.engines.offload import IdleOffload

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class VocoderStream:
    rid: str
    buf: torch.Tensor             # [groups, n] codes from absolute position `start`
    start: int = 0
    total: int = 0                # codes received
    done: int = 0                 # codes whose audio has been emitted
    samples: int = 0              # samples emitted
    final: bool = False

    def codes(self, lo: int, hi: int) -> torch.Tensor:
        return self.buf[:, lo - self.start:hi - self.start]


@dataclasses.dataclass(frozen=True)
class Window:
    """One decode of a stream: codes [lo, hi) are read, the audio of [done, end) is emitted."""
    lo: int
    end: int
    hi: int
    key: tuple = ()               # windows with equal keys decode in one batch

    @property
    def width(self) -> int:
        return self.hi - self.lo


class StreamedVocoder(StreamEngine):
    name = "vocoder"              # the engine name, for messages
    seconds_key = "vocoder_seconds"   # stats: time spent decoding

    def __init__(self, *, device: str | torch.device, groups: int, vocab: int, sample_rate: int,
                 max_num_seqs: int = 64, max_codes: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.device = torch.device(device)
        self.groups, self.vocab, self.sample_rate = groups, vocab, sample_rate
        self.max_num_seqs = max_num_seqs      # streams decoded in one batch
        self.max_codes = max_codes
        self.offload = IdleOffload(self.name, self.device, off=lambda: self.move_to(torch.device("cpu")),
                                   on=lambda: self.move_to(self.device))
        self._streams: collections.OrderedDict[str, VocoderStream] = collections.OrderedDict()
        self._stats: collections.Counter = collections.Counter()

    # -- what a subclass says ----------------------------------------------------

    @abc.abstractmethod
    def ready(self, s: VocoderStream) -> bool:
        """True when a step can emit this stream's next audio (a final stream always is)."""

    @abc.abstractmethod
    def window(self, s: VocoderStream) -> Window:
        """The next decode of a ready stream."""

    @abc.abstractmethod
    def keep_from(self, s: VocoderStream) -> int:
        """The first code any later window of this stream can read."""

    @abc.abstractmethod
    def decode(self, batch: list[tuple[VocoderStream, Window]]) -> list[torch.Tensor]:
        """Each stream's audio for its window: float32 1-D on the CPU, from sample `s.samples`."""

    @abc.abstractmethod
    def move_to(self, device: torch.device) -> None:
        """Move the weights (and whatever else lives on the device) to `device`."""

    def open_stream(self, request: EngineRequest, buf: torch.Tensor) -> VocoderStream:
        """A new stream for the first piece of a request (a subclass reads its options here)."""
        return VocoderStream(request.request_id, buf)

    def added(self, s: VocoderStream, n: int) -> None:
        """Called after `n` codes were appended to the stream."""

    def trim(self, s: VocoderStream, keep: int) -> None:
        """Drop codes before `keep` (and whatever a subclass holds per code)."""
        s.buf, s.start = s.buf[:, keep - s.start:], keep

    # -- requests ------------------------------------------------------------------

    def parse_codes(self, req: EngineRequest) -> torch.Tensor | None:
        """The piece's codes as int64 [groups, n] on the device (moved once), or None."""
        t = (req.tensors or {}).get("codes")
        if t is None:
            return None
        t = torch.as_tensor(t)
        if t.ndim == 3 and t.shape[0] == 1:
            t = t[0]
        elif t.ndim == 1 and self.groups == 1:
            t = t[None]
        if t.ndim != 2 or t.shape[0] != self.groups:
            raise EngineError(f"request {req.request_id}: codes must be int64 [{self.groups}, n], "
                              f"got shape {list(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise EngineError(f"request {req.request_id}: codes must be integers, got {t.dtype}")
        if t.numel():
            lo, hi = torch.stack([t.min(), t.max()]).tolist()     # one device sync
            if lo < 0 or hi >= self.vocab:
                raise EngineError(f"request {req.request_id}: codes must lie in [0, {self.vocab}), "
                                  f"got [{lo}, {hi}]")
        return t.to(self.device, torch.long)

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self.offload.sleeping:
            raise EngineError(f"request {rid}: {self.name} is asleep (wake_up first)")
        final = request.final
        codes = self.parse_codes(request)
        s = self._streams.get(rid)
        if s is not None and s.final:
            raise EngineError(f"request {rid}: codes after the piece marked final")
        if codes is None and not final:
            raise EngineError(f"request {rid}: no 'codes' tensor (only a final piece may omit it)")
        n = 0 if codes is None else codes.shape[1]
        if self.max_codes is not None and (s.total if s else 0) + n > self.max_codes:
            raise EngineError(f"request {rid}: {(s.total if s else 0) + n} codes exceed {self.name}'s "
                              f"limit of {self.max_codes}")
        if s is None:
            s = self.open_stream(request, torch.zeros((self.groups, 0), dtype=torch.long, device=self.device))
            self._streams[rid] = s
        if n:
            s.buf = torch.cat([s.buf, codes], dim=1)
            s.total += n
            self.added(s, n)
        s.final = final

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- work ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if self.offload.sleeping:
            return []
        ready = [s for s in self._streams.values() if self.ready(s)]
        if not ready:
            return []
        windows = {s.rid: self.window(s) for s in ready}
        # One batch: the first ready stream and every other whose window has the same key.
        key = windows[ready[0].rid].key
        batch = [(s, windows[s.rid]) for s in ready if windows[s.rid].key == key][:self.max_num_seqs]
        work = [(s, w) for s, w in batch if w.end > s.done]
        audio: dict[str, torch.Tensor] = {}
        if work:
            t0 = time.perf_counter()
            try:
                audio = {s.rid: a for (s, _), a in zip(work, self.decode(work))}
            except Exception as e:    # a request's failure is its result; the loop lives
                logger.warning("%s: decode of %s failed: %s", self.name, [s.rid for s, _ in work], e)
                return [self._failed(s, e) for s, _ in work]
            self._stats[self.seconds_key] += time.perf_counter() - t0
            self._stats["batched"] += len(work) > 1
            self._stats["codes_decoded"] += sum(w.width for _, w in work)
        outs = []
        for s, w in batch:
            a = audio.get(s.rid, torch.zeros(0))
            s.samples += a.shape[0]
            s.done = max(s.done, w.end)
            self._stats["samples"] += a.shape[0]
            done = s.final and s.done == s.total
            self.trim(s, max(s.start, self.keep_from(s)))
            if done:
                del self._streams[s.rid]
            else:
                self._streams.move_to_end(s.rid)   # round-robin
            outs.append(EngineOutput(request_id=s.rid, tensors={"audio": a}, finished=done,
                                     sample_rate=self.sample_rate, finish_reason="stop" if done else None))
        return outs

    def _failed(self, s: VocoderStream, e: Exception) -> EngineOutput:
        self._streams.pop(s.rid, None)
        return EngineOutput(request_id=s.rid, finished=True, finish_reason="error",
                            error=f"{self.name}: {type(e).__name__}: {e}")

    # -- bookkeeping -----------------------------------------------------------------

    def open_requests(self):
        return self._streams.values()

    def is_ready(self, s: VocoderStream) -> bool:
        return self.ready(s)

    def has_unfinished(self) -> bool:
        return not self.offload.sleeping and super().has_unfinished()

    def can_sleep(self) -> bool:
        return self.offload.can_sleep()

    def sleep(self, level: int = 1) -> None:
        self.offload.sleep(len(self._streams))

    def wake_up(self) -> None:
        self.offload.wake_up()

    def is_sleeping(self) -> bool:
        return self.offload.sleeping

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        if out.get("samples"):
            out["rtf"] = out.get(self.seconds_key, 0.0) / (out["samples"] / self.sample_rate)
        return out
