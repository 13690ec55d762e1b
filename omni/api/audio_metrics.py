"""Audio as the client gets it: time to first audio, seconds of audio, real-time factor and
stream underruns, per request (`AudioStream`) and as Prometheus families per model and voice
(`AudioMetrics`).

Names are vllm-omni's (vllm_omni/metrics/definitions.py): `vllm_omni:audio_ttfp_s`,
`vllm_omni:audio_duration_s`, `vllm_omni:audio_rtf`, `vllm_omni:audio_underrun_s`; the count of
late chunks has no counterpart there and is `omni_audio_underruns_total`.

A stream plays from its first chunk on: each chunk's audio is due when the audio before it has
played. A chunk handed to the stream after that (the client's player ran dry) is an underrun;
playback restarts from it. The time of a chunk is when the frontend hands it to the response
body, which a client that does not read holds back too.
"""

from __future__ import annotations

import time
from typing import Callable

from omni.metrics import AUDIO_SECONDS_BUCKETS, RTF_BUCKETS, UNDERRUN_BUCKETS, Histogram
from omni.metrics import labels as _labels

TTFA = "vllm_omni:audio_ttfp_s"
DURATION = "vllm_omni:audio_duration_s"
RTF = "vllm_omni:audio_rtf"
UNDERRUN = "vllm_omni:audio_underrun_s"
UNDERRUNS = "omni_audio_underruns_total"


class AudioMetrics:
    """A frontend's audio families, keyed by (model, voice). `voice` is the voice as resolved: a
    model speaker, or a preset's base voice, never a preset's own name (clients make presets
    without bound, and a frontend's metrics text past the master's 3 MiB is not published).
    Not locked: the event loop alone updates and renders them."""

    def __init__(self) -> None:
        self.ttfa: dict[tuple[str, str], Histogram] = {}
        self.duration: dict[tuple[str, str], Histogram] = {}
        self.rtf: dict[tuple[str, str], Histogram] = {}
        self.underrun: dict[tuple[str, str], Histogram] = {}
        self.underruns: dict[tuple[str, str], int] = {}

    @staticmethod
    def _observe(table: dict, key: tuple[str, str], buckets: tuple[float, ...], v: float) -> None:
        table.setdefault(key, Histogram(buckets)).observe(v)

    def first_audio(self, key: tuple[str, str], seconds: float) -> None:
        self._observe(self.ttfa, key, AUDIO_SECONDS_BUCKETS, seconds)

    def late_chunk(self, key: tuple[str, str]) -> None:
        self.underruns[key] = self.underruns.get(key, 0) + 1

    def completed(self, key: tuple[str, str], s: "AudioStream") -> None:
        if s.seconds <= 0:
            return
        self._observe(self.duration, key, AUDIO_SECONDS_BUCKETS, s.seconds)
        self._observe(self.rtf, key, RTF_BUCKETS, s.rtf)
        if s.streamed:
            self._observe(self.underrun, key, UNDERRUN_BUCKETS, s.max_underrun_s)

    def render(self, frontend: str) -> list[str]:
        def lab(key: tuple[str, str]) -> dict[str, str]:
            return {"model_name": key[0], "voice": key[1], "frontend": frontend}

        lines: list[str] = []
        for name, table, help_ in (
            (TTFA, self.ttfa, "Time from request arrival to the first audio chunk handed to a stream."),
            (DURATION, self.duration, "Seconds of audio per completed request (the _sum: audio produced)."),
            (RTF, self.rtf, "Per completed request: (last audio chunk - arrival) / seconds of audio."),
            (UNDERRUN, self.underrun, "Per completed stream: the longest wait of a player that ran dry."),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
            for key, h in sorted(table.items()):
                lines += h.lines(name, lab(key))
        lines += [f"# HELP {UNDERRUNS} Stream chunks handed out after the audio before them had played.",
                  f"# TYPE {UNDERRUNS} counter"]
        lines += [f"{UNDERRUNS}{_labels(lab(key))} {n}" for key, n in sorted(self.underruns.items())]
        return lines


class AudioStream:
    """One request's audio. `streamed`: a client receives each chunk as it is made (TTFA and
    underruns count only then, as in vllm-omni and SGLang-Omni); otherwise only the duration and
    RTF of a completed request count."""

    def __init__(self, metrics: AudioMetrics, model: str, voice: str, t0: float, streamed: bool,
                 clock: Callable[[], float] = time.monotonic):
        self._metrics, self._key, self._clock = metrics, (model, voice), clock
        self.t0, self.streamed = t0, streamed
        self.first_s: float | None = None     # arrival -> first chunk
        self.last_s = 0.0                     # arrival -> last chunk
        self.seconds = 0.0
        self.underruns = 0
        self.max_underrun_s = 0.0
        self._play_end = 0.0                  # when the audio handed out so far has played

    def chunk(self, samples: int, rate: int) -> None:
        if samples <= 0 or rate <= 0:
            return
        now = self._clock()
        d = samples / rate
        if self.first_s is None:
            self.first_s = now - self.t0
            self._play_end = now
            if self.streamed:
                self._metrics.first_audio(self._key, self.first_s)
        elif now > self._play_end:
            self.max_underrun_s = max(self.max_underrun_s, now - self._play_end)
            self._play_end = now
            if self.streamed:
                self.underruns += 1
                self._metrics.late_chunk(self._key)
        self._play_end += d
        self.seconds += d
        self.last_s = now - self.t0

    @property
    def rtf(self) -> float:
        return self.last_s / self.seconds if self.seconds else 0.0

    def completed(self) -> None:
        self._metrics.completed(self._key, self)

    def usage(self) -> dict:
        """The request's `usage` fields (vllm-omni's names for these figures)."""
        return {"audio_duration_s": round(self.seconds, 6),
                "audio_ttfp_s": None if self.first_s is None else round(self.first_s, 6)}
