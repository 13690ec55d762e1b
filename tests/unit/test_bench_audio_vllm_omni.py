"""The pure parts of benchmarks/audio_vllm_omni.py: /metrics scraped over frontends and voices,
and a level's row judging the client against the server."""

from __future__ import annotations

from benchmarks import audio_vllm_omni as b
from benchmarks.omni_chat_client import Result
from omni.api.audio_metrics import AudioStream
from omni.api.metrics import FrontendMetrics
from omni.api.metrics_merge import merge


def served(ttfa: list[float], seconds: list[float], last: list[float]) -> str:
    texts = []
    for i, (f, s, t) in enumerate(zip(ttfa, seconds, last)):
        fm = FrontendMetrics(i, "m")
        clock = [0.0]
        a = AudioStream(fm.audio, "m", f"v{i}", 0.0, True, clock=lambda c=clock: c[0])
        clock[0] = f
        a.chunk(int(s * 1000 / 2), 1000)
        clock[0] = t
        a.chunk(int(s * 1000 / 2), 1000)
        a.completed()
        texts.append(fm.render())
    return merge(texts)


def test_scrape_sums_every_frontend_and_voice():
    got = b.scrape(served([0.1, 0.3], [2.0, 4.0], [1.0, 2.0]))
    assert got["vllm_omni:audio_ttfp_s_count"] == 2 and abs(got["vllm_omni:audio_ttfp_s_sum"] - 0.4) < 1e-9
    assert got["vllm_omni:audio_duration_s_sum"] == 6.0
    assert abs(got["vllm_omni:audio_rtf_sum"] - (0.5 + 0.5)) < 1e-9


def test_row_agrees_within_the_tolerance_only():
    def res(ttfp, dur, rtf):
        return Result(ok=True, audio_ttfp=ttfp, audio_duration=dur, audio_rtf=rtf)

    delta = {"vllm_omni:audio_ttfp_s_count": 2, "vllm_omni:audio_ttfp_s_sum": 0.4,
             "vllm_omni:audio_rtf_count": 2, "vllm_omni:audio_rtf_sum": 1.0, "vllm_omni:audio_duration_s_sum": 6.0}
    r = b.row(4, [res(0.101, 2.0, 0.5), res(0.301, 4.0, 0.51)], 3.0, delta)
    assert r["agree"] and r["ttfa_ms_mean"] == 201.0 and r["server_ttfa_ms_mean"] == 200.0
    assert r["audio_s_per_s"] == r["server_audio_s_per_s"] == 2.0
    late = b.row(4, [res(0.15, 2.0, 0.5), res(0.35, 4.0, 0.5)], 3.0, delta)   # 25% slower first audio
    assert not late["agree"] and late["ratios"]["ttfa_mean"] == 1.25
    missing = b.row(4, [res(0.101, 2.0, 0.5), res(0.301, 4.0, 0.5), res(0.2, 1.0, 0.5)], 3.0, delta)
    assert not missing["agree"]            # /metrics counted fewer first audios than the client saw
