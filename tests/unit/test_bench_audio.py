"""The pure parts of benchmarks/audio.py (rows, paired comparisons) and the speech hops of
benchmarks/latency_trace_report.py over a hand-made trace."""

from __future__ import annotations

import json

import pytest

from benchmarks import audio
from benchmarks import latency_trace_report as tr


def rec(first: float, done: float = 1.0, samples: int = 22050) -> dict:
    return {"first": first, "done": done, "samples": samples}


def test_paired_differences_follow_the_texts_not_the_mix():
    # Two texts, one fast (0.1 s) and one slow (0.2 s) to first audio; omni is 5 ms behind on each.
    inproc = [rec(0.1), rec(0.2), rec(0.1), rec(0.2)]
    omni = [rec(0.105), rec(0.205), rec(0.105), rec(0.205)]
    a = audio.speech_row("omni", 1, omni, 4.0, [1.0, 1.0, 1.0], server_ttfa_ms=100.0)
    b = audio.speech_row("in-process", 1, inproc, 4.0, [1.0, 1.0, 1.0])
    assert a["ttfa_ms_p50"] == 155.0 and b["ttfa_ms_p50"] == 150.0
    assert a["ttfa_ms_p10"] == 105.0 and a["ttfa_ms_p90"] == 205.0
    assert a["server_ttfa_ms_mean"] == 100.0 and a["aggregate_rtf"] == 1.0 and a["audio_seconds"] == 4.0
    c = audio.compare(1, 4, a, b, omni, inproc)
    assert (c["a"], c["b"]) == ("omni", "in-process")
    assert c["paired_delta_ms"]["p50"] == pytest.approx(5.0)
    assert c["paired_delta_ms"]["min"] == pytest.approx(5.0) and c["paired_delta_ms"]["max"] == pytest.approx(5.0)


def test_chat_row_has_first_sentence_and_audio_after_it():
    recs = [{**rec(0.5, 2.0), "sentence": 0.3}, {**rec(0.7, 2.0), "sentence": 0.4}]
    r = audio.chat_row(1, recs, 4.0, [2.0, 2.0, 2.0])
    assert r["route"] == "chat" and r["ttfa_ms_p50"] == 600.0
    assert r["first_sentence_ms_p50"] == 350.0 and r["audio_after_sentence_ms_p50"] == 250.0
    assert "1st sent" in audio.table([r]).splitlines()[0]


def test_speech_report_splits_first_audio_into_hops(tmp_path):
    def w(name, events):
        (tmp_path / name).write_text("".join(json.dumps(e) + "\n" for e in events))

    rid = "speech-abc"
    w("frontend0-1.jsonl", [{"t": 10.0, "p": "arrived", "r": rid, "n": 0, "at": 9.999},
                            {"t": 10.150, "p": "audio", "r": rid, "n": 100},
                            {"t": 10.300, "p": "audio", "r": rid, "n": 100},
                            # A request outside the window: left out.
                            {"t": 50.0, "p": "arrived", "r": "speech-late", "n": 0},
                            {"t": 50.2, "p": "audio", "r": "speech-late", "n": 100},
                            # Not speech: left out.
                            {"t": 10.0, "p": "arrived", "r": "chatcmpl-x", "n": 0}])
    w("stage1-2.jsonl", [{"t": 10.001, "p": "added", "r": rid, "n": 0},
                         {"t": 10.070, "p": "sent", "r": rid, "n": 0}, {"t": 10.200, "p": "sent", "r": rid, "n": 0},
                         {"t": 50.01, "p": "added", "r": "speech-late", "n": 0},
                         {"t": 50.1, "p": "sent", "r": "speech-late", "n": 0}])
    # code2wav sees the request as a sub-request id: rid/sub.
    w("stage2-3.jsonl", [{"t": 10.072, "p": "added", "r": f"{rid}/0", "n": 0},
                         {"t": 10.148, "p": "sent", "r": f"{rid}/0", "n": 0},
                         {"t": 10.202, "p": "added", "r": f"{rid}/0", "n": 0},
                         {"t": 50.11, "p": "added", "r": "speech-late", "n": 0},
                         {"t": 50.19, "p": "sent", "r": "speech-late", "n": 0}])
    hops = tr.speech_report(str(tmp_path), 0.0, 20.0)
    want = {"request in -> talker added": 2.0, "talker added -> sent (its step)": 69.0,
            "talker sent -> code2wav added": 2.0, "code2wav added -> sent (its step)": 76.0,
            "code2wav sent -> frontend audio": 2.0, "request in -> frontend audio": 151.0}
    for name, ms in want.items():
        assert hops[name]["n"] == 1, name
        assert hops[name]["p50"] == pytest.approx(ms, abs=1e-6), name
    assert tr.speech_report(str(tmp_path))["request in -> frontend audio"]["n"] == 2


def test_the_reference_decodes_with_the_deployed_chunking_unless_told(capsys):
    from benchmarks import audio_reference as ref

    deployed = audio.code2wav_args()
    a = ref.parse([])
    assert (a.chunk_frames, a.first_chunk_frames, a.context_frames, a.threads) == (
        deployed.chunk_frames, deployed.first_chunk_frames, deployed.context_frames, deployed.threads) == (64, 16, 16, 1)
    assert ref.parse(["--chunk-frames", "48"]).chunk_frames == 48
    with pytest.raises(SystemExit):
        ref.parse(["--chunk-frames", "0"])
    assert "--chunk-frames must be at least 1, got 0" in capsys.readouterr().err
