"""Prometheus text-exposition pieces (no client library), shared by the orchestrator's and
the HTTP frontend's metrics so neither imports the other."""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFO_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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
