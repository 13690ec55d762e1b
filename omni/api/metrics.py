"""The frontend's own Prometheus metrics, written as text exposition (no client library)."""

from __future__ import annotations

import threading

from omni.api.audio_metrics import AudioMetrics
from omni.metrics import LATENCY_BUCKETS, TTFO_BUCKETS, Histogram
from omni.metrics import labels as _labels


TEXT_ROUTES = ("/v1/chat/completions", "/v1/completions")


class FrontendMetrics:
    """Request counts by route/status, in-flight requests, latency, time to first output, audio."""

    def __init__(self, frontend_index: int = 0, model_name: str = ""):
        self._base = {"frontend": str(frontend_index)}
        self._vllm = {"model_name": model_name, **self._base}   # vLLM's names and its label
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFO_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.latency: dict[str, Histogram] = {}
        self.ttfo: dict[str, Histogram] = {}
        self.audio = AudioMetrics()

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)
            if route in TEXT_ROUTES:
                self.e2e.observe(seconds)

    def first_output(self, route: str, seconds: float) -> None:
        with self._lock:
            self.ttfo.setdefault(route, Histogram(TTFO_BUCKETS)).observe(seconds)
            if route in TEXT_ROUTES:
                self.ttft.observe(seconds)

    def tokens(self, prompt: int, generation: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generation

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
            lines += [
                "# HELP vllm:prompt_tokens_total Prefill tokens processed (chat and completions).",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{_labels(self._vllm)} {self.prompt_tokens}",
                "# HELP vllm:generation_tokens_total Generated tokens (chat and completions).",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{_labels(self._vllm)} {self.generation_tokens}",
                "# HELP vllm:time_to_first_token_seconds Time to the first token (chat and completions).",
                "# TYPE vllm:time_to_first_token_seconds histogram",
                *self.ttft.lines("vllm:time_to_first_token_seconds", self._vllm),
                "# HELP vllm:e2e_request_latency_seconds End-to-end latency of chat and completions requests.",
                "# TYPE vllm:e2e_request_latency_seconds histogram",
                *self.e2e.lines("vllm:e2e_request_latency_seconds", self._vllm),
                *self.audio.render(self._base["frontend"]),
            ]
            return "\n".join(lines) + "\n"
