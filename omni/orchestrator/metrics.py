"""The orchestrator's Prometheus metrics (per stage and per frontend)."""

from __future__ import annotations

import time

from omni.metrics import (BATCH_BUCKETS, BATCH_KEY, ENGINE_GAUGE, LATENCY_BUCKETS, STEP_BUCKETS, STEP_KEY, TTFO_BUCKETS,
                          Histogram)
from omni.metrics import labels as _labels

OUTCOMES = ("ok", "aborted", "failed")
ENGINE_STEP = "omni_stage_engine_step_seconds"
ENGINE_BATCH = "omni_stage_engine_batch_size"


def render_engine_steps(replicas) -> str:
    """The stages' own per-step histograms, from their load reports in the topology (a second or
    so behind): stages whose engine computes in the stage process (the speech stages; vLLM
    stages step in their EngineCore and report none). Per replica, not per frontend: the
    frontend that answers /metrics renders them (they are not published with its own)."""
    out = {ENGINE_STEP: [f"# HELP {ENGINE_STEP} Engine step time, steps with work (stage-reported).",
                         f"# TYPE {ENGINE_STEP} histogram"],
           ENGINE_BATCH: [f"# HELP {ENGINE_BATCH} Requests the engine had ready per step (stage-reported).",
                          f"# TYPE {ENGINE_BATCH} histogram"]}
    for r in sorted(replicas, key=lambda r: (r.stage_id, r.replica_index)):
        if r.role != "STAGE" or r.state == "DEAD":
            continue
        lab = {"stage": str(r.stage_id), "replica": str(r.replica_index)}
        for name, key, buckets in ((ENGINE_STEP, STEP_KEY, STEP_BUCKETS), (ENGINE_BATCH, BATCH_KEY, BATCH_BUCKETS)):
            h = Histogram.from_flat(buckets, key, r.extra)
            if h is not None:
                out[name] += h.lines(name, lab)
        for key in sorted(k for k in r.extra if k.startswith(ENGINE_GAUGE)):
            gauge = "omni_stage_engine_" + key[len(ENGINE_GAUGE):]
            if gauge not in out:
                out[gauge] = [f"# HELP {gauge} The engine's own gauge (stage-reported).", f"# TYPE {gauge} gauge"]
            out[gauge].append(f"{gauge}{_labels(lab)} {r.extra[key]}")
    return "".join(line + "\n" for lines in out.values() for line in lines)


class OrchestratorMetrics:
    def __init__(self) -> None:
        self.requests_total = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)   # finished requests: completed, client gone, failed
        self.tensor_bytes_by_transport: dict[str, int] = {}
        self.replays: dict[int, int] = {}     # stage -> requests moved off a dead replica
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.ttfo = Histogram(TTFO_BUCKETS)
        self.queue: dict[int, Histogram] = {}
        self.stage_ttfo: dict[int, Histogram] = {}
        self.step: dict[int, Histogram] = {}
        self.out_queue: dict[int, Histogram] = {}

    def request_started(self) -> None:
        self.requests_total += 1

    def request_finished(self, outcome: str, seconds: float) -> None:
        self.outcomes[outcome] += 1
        self.e2e.observe(seconds)

    def first_output(self, seconds: float) -> None:
        self.ttfo.observe(seconds)

    def stage_queue(self, stage: int, seconds: float) -> None:
        self.queue.setdefault(stage, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def stage_first_output(self, stage: int, seconds: float) -> None:
        self.stage_ttfo.setdefault(stage, Histogram(TTFO_BUCKETS)).observe(seconds)

    def output_queue(self, stage: int, seconds: float) -> None:
        self.out_queue.setdefault(stage, Histogram(STEP_BUCKETS)).observe(seconds)

    @property
    def tensor_bytes_total(self) -> int:
        return sum(self.tensor_bytes_by_transport.values())

    def replayed(self, stage: int) -> None:
        self.replays[stage] = self.replays.get(stage, 0) + 1

    def stage_step(self, stage: int, seconds: float) -> None:
        self.step.setdefault(stage, Histogram(STEP_BUCKETS)).observe(seconds)

    def render(self, frontend_id: str) -> str:
        fe = {"frontend": frontend_id}
        lines = [
            "# HELP omni_pipeline_requests_total Finished requests: ok (completed), aborted (client gone), failed.",
            "# TYPE omni_pipeline_requests_total counter",
            *(f"omni_pipeline_requests_total{_labels({**fe, 'outcome': k})} {n}" for k, n in self.outcomes.items()),
            "# TYPE omni_frontend_cpu_seconds_total counter",
            f"omni_frontend_cpu_seconds_total{_labels(fe)} {time.process_time():.3f}",
            "# TYPE omni_frontend_in_flight gauge",
            f"omni_frontend_in_flight{_labels(fe)} {self.requests_total - sum(self.outcomes.values())}",
            "# HELP omni_tensor_bytes_total Bytes of tensors this frontend routed or received, by transport.",
            "# TYPE omni_tensor_bytes_total counter",
            *(f"omni_tensor_bytes_total{_labels({**fe, 'transport': t})} {n}"
              for t, n in sorted(self.tensor_bytes_by_transport.items())),
            "# HELP omni_stage_replays_total Requests moved to another replica when theirs died before any output.",
            "# TYPE omni_stage_replays_total counter",
            *(f"omni_stage_replays_total{_labels({**fe, 'stage': str(s)})} {n}"
              for s, n in sorted(self.replays.items())),
            "# TYPE omni_pipeline_e2e_seconds histogram",
            *self.e2e.lines("omni_pipeline_e2e_seconds", fe),
            "# TYPE omni_pipeline_first_output_seconds histogram",
            *self.ttfo.lines("omni_pipeline_first_output_seconds", fe),
        ]
        for name, table in (("omni_stage_queue_seconds", self.queue),
                            ("omni_stage_output_queue_seconds", self.out_queue),
                            ("omni_stage_first_output_seconds", self.stage_ttfo),
                            ("omni_stage_step_seconds", self.step)):
            lines.append(f"# TYPE {name} histogram")
            for stage, h in sorted(table.items()):
                lines.extend(h.lines(name, {**fe, "stage": str(stage)}))
        return "\n".join(lines) + "\n"

    def tensor_bytes(self, n: int, transport: str) -> None:
        self.tensor_bytes_by_transport[transport] = self.tensor_bytes_by_transport.get(transport, 0) + n
