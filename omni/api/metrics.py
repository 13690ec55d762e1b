"""The frontend's own Prometheus metrics, written as text exposition (no client library)."""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFO_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = (lambda v: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.buckets + (float("inf"),), self.counts):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {cum}")
        out.append(f"{name}_sum{_labels(labels)} {self.sum!r}")
        out.append(f"{name}_count{_labels(labels)} {cum}")
        return out


class FrontendMetrics:
    """Request counts by route/status, in-flight requests, latency and time to first output."""

    def __init__(self, frontend_index: int = 0):
        self._base = {"frontend": str(frontend_index)}
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.latency: dict[str, Histogram] = {}
        self.ttfo: dict[str, Histogram] = {}

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def first_output(self, route: str, seconds: float) -> None:
        with self._lock:
            self.ttfo.setdefault(route, Histogram(TTFO_BUCKETS)).observe(seconds)

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP omni_api_requests_total HTTP requests answered, by route and status.",
                     "# TYPE omni_api_requests_total counter"]
            for (route, status), n in sorted(self.requests.items()):
                labels = _labels({**self._base, "route": route, "status": str(status)})
                lines.append(f"omni_api_requests_total{labels} {n}")
            lines += ["# HELP omni_api_requests_in_flight HTTP requests being served now.",
                      "# TYPE omni_api_requests_in_flight gauge",
                      f"omni_api_requests_in_flight{_labels(self._base)} {self.in_flight}"]
            for name, hists, help_ in (
                ("omni_api_request_duration_seconds", self.latency,
                 "End-to-end request latency (until the last body byte)."),
                ("omni_api_time_to_first_output_seconds", self.ttfo,
                 "Time from request arrival to the first pipeline output."),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
                for route, h in sorted(hists.items()):
                    lines += h.lines(name, {**self._base, "route": route})
            return "\n".join(lines) + "\n"
