"""Prometheus text-exposition pieces (no client library), shared by the orchestrator's and
the HTTP frontend's metrics so neither imports the other."""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFO_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# vllm-omni's buckets for its audio families (vllm_omni/metrics/definitions.py), so dashboards match.
AUDIO_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
UNDERRUN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
RTF_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A stage's per-step histograms in its keep-alive `extra` (Histogram.to_flat prefixes), which
# the frontend's /metrics renders (omni.orchestrator.metrics.render_engine_steps).
STEP_KEY, BATCH_KEY = "engine_step_s", "engine_batch"
# An engine's own gauges (Engine.load_extra) in the same `extra`, rendered as omni_stage_engine_<name>.
ENGINE_GAUGE = "engine."


def _escape(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in d.items()) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def lines(self, name: str, label_set: dict[str, str]) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.buckets + (float("inf"),), self.counts):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f"{name}_bucket{labels({**label_set, 'le': le})} {cum}")
        out.append(f"{name}_sum{labels(label_set)} {self.sum!r}")
        out.append(f"{name}_count{labels(label_set)} {cum}")
        return out

    def to_flat(self, prefix: str) -> dict[str, float]:
        """The histogram as plain numbers (a stage's keep-alive `extra`): `prefix.<i>` per bucket, `prefix.sum`."""
        return {**{f"{prefix}.{i}": float(c) for i, c in enumerate(self.counts)}, f"{prefix}.sum": self.sum}

    @classmethod
    def from_flat(cls, buckets: tuple[float, ...], prefix: str, flat: dict[str, float]) -> "Histogram | None":
        """The inverse of to_flat; None when `flat` lacks it (an older replica) or has other buckets."""
        if f"{prefix}.sum" not in flat or f"{prefix}.{len(buckets) + 1}" in flat:
            return None
        h = cls(buckets)
        try:
            h.counts = [int(flat[f"{prefix}.{i}"]) for i in range(len(buckets) + 1)]
        except KeyError:
            return None
        h.sum = flat[f"{prefix}.sum"]
        return h
