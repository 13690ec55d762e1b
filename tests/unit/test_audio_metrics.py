"""The audio figures' arithmetic (omni/api/audio_metrics.py) on a hand-driven clock, their
exposition merged across frontends, and the stages' per-step histograms through a load report."""

from __future__ import annotations

import re

import pytest

from omni.api.audio_metrics import AudioMetrics, AudioStream
from omni.api.metrics import FrontendMetrics
from omni.api.metrics_merge import merge
from omni.master.types import ReplicaInfo
from omni.metrics import BATCH_BUCKETS, STEP_BUCKETS, Histogram
from omni.orchestrator.metrics import render_engine_steps

RATE = 1000   # samples per second: a chunk of n samples lasts n ms


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample; every label given must match."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"no {name} {labels} in:\n{text}")


def stream(metrics: AudioMetrics, clock: Clock, streamed: bool = True) -> AudioStream:
    return AudioStream(metrics, "tiny", "joe", clock.t, streamed, clock=clock)


def test_a_stream_that_keeps_ahead_has_no_underrun():
    m, clock = AudioMetrics(), Clock()
    s = stream(m, clock)
    clock.t += 0.2
    s.chunk(500, RATE)           # first audio at 0.2 s; plays until 0.7 s
    clock.t += 0.4
    s.chunk(500, RATE)           # at 0.6 s, before 0.7 s: queued, plays until 1.2 s
    clock.t += 0.6
    s.chunk(250, RATE)           # at 1.2 s exactly: on time
    s.completed()
    assert s.first_s == pytest.approx(0.2) and s.seconds == pytest.approx(1.25)
    assert s.underruns == 0 and s.max_underrun_s == 0.0
    assert s.rtf == pytest.approx(1.2 / 1.25)
    key = ("tiny", "joe")
    assert sum(m.ttfa[key].counts) == 1 and m.ttfa[key].sum == pytest.approx(0.2)
    assert m.duration[key].sum == pytest.approx(1.25) and m.rtf[key].sum == pytest.approx(0.96)
    assert m.underrun[key].sum == 0.0 and m.underruns == {}
    assert s.usage() == {"audio_duration_s": 1.25, "audio_ttfp_s": 0.2}


def test_a_late_chunk_is_an_underrun_and_playback_restarts_from_it():
    m, clock = AudioMetrics(), Clock()
    s = stream(m, clock)
    clock.t += 0.1
    s.chunk(100, RATE)            # plays 0.1 .. 0.2
    clock.t += 0.3
    s.chunk(100, RATE)            # at 0.4: the player waited 0.2 s; plays 0.4 .. 0.5
    clock.t += 0.15
    s.chunk(100, RATE)            # at 0.55: waited 0.05 s
    clock.t += 0.05
    s.chunk(100, RATE)            # at 0.6, the previous one plays until 0.65: on time
    s.completed()
    assert s.underruns == 2 and s.max_underrun_s == pytest.approx(0.2)
    key = ("tiny", "joe")
    assert m.underruns[key] == 2
    assert m.underrun[key].sum == pytest.approx(0.2)           # one value per stream: the longest wait
    assert sum(m.ttfa[key].counts) == 1                        # first audio once, not per chunk
    text = "\n".join(m.render("3"))
    assert sample(text, "omni_audio_underruns_total", model_name="tiny", voice="joe", frontend="3") == 2
    assert sample(text, "vllm_omni:audio_ttfp_s_count", voice="joe") == 1
    assert sample(text, "vllm_omni:audio_rtf_sum", voice="joe") == pytest.approx(0.6 / 0.4)


def test_a_whole_response_counts_seconds_and_rtf_but_no_stream_figures():
    m, clock = AudioMetrics(), Clock()
    s = stream(m, clock, streamed=False)
    clock.t += 0.5
    s.chunk(300, RATE)
    clock.t += 2.0
    s.chunk(300, RATE)            # late, but nobody was playing it
    s.completed()
    assert m.ttfa == {} and m.underrun == {} and m.underruns == {}
    assert m.duration[("tiny", "joe")].sum == pytest.approx(0.6)
    assert s.usage()["audio_ttfp_s"] == 0.5     # the request's own figure still says when audio was there


def test_an_unfinished_request_adds_no_duration_and_empty_chunks_count_nothing():
    m, clock = AudioMetrics(), Clock()
    s = stream(m, clock)
    s.chunk(0, RATE)
    assert s.first_s is None and m.ttfa == {}
    clock.t += 0.1
    s.chunk(100, RATE)
    assert sum(m.ttfa[("tiny", "joe")].counts) == 1 and m.duration == {}    # never completed
    assert AudioStream(m, "tiny", "amy", clock.t, True, clock=clock).usage() == {
        "audio_duration_s": 0.0, "audio_ttfp_s": None}


def test_frontends_merge_into_one_family_per_name():
    texts = []
    for i, voice in enumerate(("joe", "amy")):
        fm = FrontendMetrics(i, "tiny")
        clock = Clock()
        s = AudioStream(fm.audio, "tiny", voice, clock.t, True, clock=clock)
        clock.t += 0.25
        s.chunk(RATE, RATE)
        s.completed()
        texts.append(fm.render())
    merged = merge(texts)
    for name in ("vllm_omni:audio_ttfp_s", "vllm_omni:audio_duration_s", "vllm_omni:audio_rtf",
                 "vllm_omni:audio_underrun_s", "omni_audio_underruns_total"):
        assert merged.count(f"# TYPE {name} ") == 1, name
    assert sample(merged, "vllm_omni:audio_duration_s_sum", voice="joe", frontend="0") == 1.0
    assert sample(merged, "vllm_omni:audio_duration_s_sum", voice="amy", frontend="1") == 1.0
    assert sample(merged, "vllm_omni:audio_ttfp_s_bucket", voice="amy", le="0.25") == 1
    assert sample(merged, "vllm_omni:audio_ttfp_s_bucket", voice="amy", le="0.1") == 0


def replica(stage_id: int, index: int, extra: dict, role: str = "STAGE", state: str = "READY") -> ReplicaInfo:
    return ReplicaInfo(stage_id=stage_id, replica_id=f"r{stage_id}.{index}", replica_index=index, role=role,
                       host="h", pid=1, endpoints={}, state=state, queue_len=0, in_flight=0, requests_total=0,
                       cpu_seconds=0.0, is_sleeping=False, draining=False, extra=extra, heartbeat_age_s=0.0,
                       version="", capabilities={})


def test_stage_step_histograms_survive_the_load_report():
    from omni.stage.worker_state import WorkerStats

    st = WorkerStats()
    for seconds, batch in ((0.004, 1), (0.02, 3), (0.02, 3), (0.3, 16)):
        st.engine_step(seconds, batch)
    extra = st.step_report()
    assert all(isinstance(v, float) for v in extra.values())    # the keep-alive carries plain numbers
    text = render_engine_steps([replica(2, 0, extra), replica(0, 0, {"steps": 5.0}),
                                replica(-1, 0, extra, role="FRONTEND"), replica(1, 1, extra, state="DEAD")])
    assert sample(text, "omni_stage_engine_batch_size_count", stage="2", replica="0") == 4
    assert sample(text, "omni_stage_engine_batch_size_sum", stage="2") == 23
    assert sample(text, "omni_stage_engine_batch_size_bucket", stage="2", le="4") == 3
    assert sample(text, "omni_stage_engine_step_seconds_sum", stage="2") == pytest.approx(0.344)
    assert sample(text, "omni_stage_engine_step_seconds_bucket", stage="2", le="0.025") == 3
    assert 'stage="0"' not in text and 'stage="1"' not in text and 'stage="-1"' not in text
    assert WorkerStats().step_report() == {}       # no work, nothing in the keep-alive


def test_flat_histograms_refuse_other_buckets():
    h = Histogram(STEP_BUCKETS)
    h.observe(0.01)
    flat = h.to_flat("x")
    assert Histogram.from_flat(STEP_BUCKETS, "x", flat).counts == h.counts
    assert Histogram.from_flat(BATCH_BUCKETS, "x", flat) is None      # more buckets than asked for
    assert Histogram.from_flat(STEP_BUCKETS + (2.0,), "x", flat) is None
    assert Histogram.from_flat(STEP_BUCKETS, "y", flat) is None
