"""The pure parts of benchmarks/qwen3_omni.py: sentence detection, per-row statistics, the
omni vs in-process comparison (goals) per model, the --model choice, and the table and JSON
carrying the same figures."""

from __future__ import annotations

import json

import pytest

from benchmarks import qwen3_omni as b


@pytest.mark.parametrize("text, done", [
    ("", False), ("Hello there", False), ("Hello there.", True), ("Hello. And", True),
    ("3.5 apples", False), ("Really?", True), ("Wow! Yes", True), ("e.g", False),
])
def test_sentence_done(text, done):
    assert b.sentence_done(text) is done


def rec(ttft, sentence, ttfa, done, seconds, text_done=None):
    return {"ttft": ttft, "sentence": sentence, "text_done": text_done if text_done is not None else sentence,
            "ttfa": ttfa, "done": done, "samples": int(seconds * b.RATE)}


def test_summarize_medians_gap_and_rtf():
    recs = [rec(0.01, 0.5, 0.2, 2.0, 2.0, 0.9), rec(0.03, 0.7, 0.4, 3.0, 2.0, 1.1), rec(0.02, 0.6, 0.3, 4.0, 2.0, 1.0)]
    row = b.summarize("qwen3", "omni", 1, recs, wall=9.0)
    assert row["model"] == "qwen3" and row["mode"] == "omni"
    assert row["ttft_ms_p50"] == 20.0 and row["sentence_ms_p50"] == 600.0 and row["text_done_ms_p50"] == 1000.0
    assert row["ttfa_ms_p50"] == 300.0 and row["ttfa_ms_p90"] == 400.0
    assert row["ttfa_after_sentence_ms_p50"] == -300.0          # audio before the sentence ended
    assert row["latency_ms_p50"] == 3000.0
    assert row["request_rtf_mean"] == 1.5                        # (1 + 1.5 + 2) / 3
    assert row["aggregate_rtf"] == 1.5 and row["audio_seconds"] == 6.0   # 9 s of wall for 6 s of audio


def test_summarize_without_audio_leaves_the_audio_figures_empty():
    row = b.summarize("qwen25", "in-process", 4, [rec(0.01, None, None, 0.5, 0)], wall=0.5)
    assert row["ttfa_ms_p50"] is None and row["ttfa_after_sentence_ms_p50"] is None
    assert row["sentence_ms_p50"] is None and row["aggregate_rtf"] is None and row["request_rtf_mean"] is None


def row(mode, level, ttfa, rtf, model="qwen3"):
    return {"model": model, "mode": mode, "concurrency": level, "ttfa_ms_p50": ttfa, "aggregate_rtf": rtf}


def test_compare_states_overhead_ratio_and_goals():
    rows = [row("omni", 1, 105.0, 0.5), row("in-process", 1, 100.0, 0.4),
            row("omni", 4, 90.0, 0.3), row("in-process", 4, 100.0, 0.4)]
    c1, c4 = b.compare(rows)
    assert (c1["concurrency"], c1["ttfa_overhead_pct"], c1["rtf_ratio"], c1["met"]) == (1, 5.0, 1.25, True)
    assert (c4["ttfa_overhead_pct"], c4["rtf_ratio"], c4["met"]) == (-10.0, 0.75, True)
    slow = b.compare([row("omni", 1, 111.0, 0.4), row("in-process", 1, 100.0, 0.4)])
    assert slow[0]["met"] is False
    # Ahead at 4 needs both: a lower TTFA with a higher RTF is not ahead.
    mixed = b.compare([row("omni", 4, 90.0, 0.5), row("in-process", 4, 100.0, 0.4)])
    assert mixed[0]["met"] is False


def test_compare_skips_a_level_missing_a_side():
    assert b.compare([row("omni", 1, 100.0, 0.5), row("in-process", 4, 100.0, 0.5)]) == []
    # Sides of different models are never compared with each other.
    assert b.compare([row("omni", 1, 100.0, 0.5), row("in-process", 1, 100.0, 0.5, "qwen25")]) == []


def test_compare_keeps_the_models_apart():
    rows = [row("omni", 1, 105.0, 0.5), row("in-process", 1, 100.0, 0.4),
            row("omni", 1, 300.0, 0.8, "qwen25"), row("in-process", 1, 200.0, 0.8, "qwen25")]
    by = {c["model"]: c for c in b.compare(rows)}
    assert by["qwen3"]["ttfa_overhead_pct"] == 5.0 and by["qwen3"]["met"] is True
    assert by["qwen25"]["ttfa_overhead_pct"] == 50.0 and by["qwen25"]["met"] is False


def test_pick_models_by_name_or_folder_model_type(tmp_path):
    assert [m.key for m, _ in b.pick_models("both")] == ["qwen3", "qwen25"]
    assert b.pick_models("qwen25") == [(b.MODELS["qwen25"], None)]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    assert b.pick_models(str(tmp_path)) == [(b.MODELS["qwen25"], tmp_path)]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match="model_type 'llama'"):
        b.pick_models(str(tmp_path))
    with pytest.raises(SystemExit, match="qwen3, qwen25 or both"):
        b.pick_models(str(tmp_path / "nowhere"))


def test_table_shows_the_figures_the_json_carries():
    rows = [b.summarize("qwen3", "omni", 1, [rec(0.04, 0.5, 0.42, 2.0, 2.0)], 2.0),
            b.summarize("qwen3", "in-process", 1, [rec(0.02, 0.5, 0.40, 2.0, 2.0)], 2.0),
            b.summarize("qwen25", "omni", 1, [rec(0.05, 0.3, 0.93, 1.5, 1.0, 0.35)], 1.5)]
    doc = {"models": [{"name": "qwen3-omni-tiny", "thinker_tokens": 16, "talker_tokens": 24,
                       "load_average_start": [3.5, 3.0, 2.5], "startup_seconds": 41.0},
                      {"name": "qwen25-omni-tiny", "thinker_tokens": 16, "talker_tokens": 48,
                       "load_average_start": [1.5, 1.0, 0.5], "startup_seconds": 42.0}],
           "cpus": 2, "seconds": 80.0, "rows": rows, "comparison": b.compare(rows),
           "stage_load": {"qwen3 omni c1": {"talker": {"cpu_s": 1.5, "step_s": 2.0, "steps": 30}}}}
    text = b.table(doc)
    assert "qwen3-omni-tiny thinker 16 / talker 24 tokens, load average [3.5, 3.0, 2.5] at its start" in text
    assert "qwen25-omni-tiny thinker 16 / talker 48 tokens" in text
    assert "420.0" in text and "400.0" in text
    qwen25 = next(line for line in text.splitlines() if line.lstrip().startswith("qwen25"))
    assert "930.0" in qwen25 and "350.0" in qwen25 and "50.0" in qwen25      # TTFA, text end, TTFT
    assert "qwen3 concurrency 1: omni TTFA overhead +5.0%" in text and "goal (TTFA overhead < 10%): met" in text
    assert "talker cpu_s 1.5 step_s 2.0 steps 30" in text
    assert json.loads(json.dumps(doc))["comparison"][0]["ttfa_overhead_pct"] == 5.0


def test_stage_first_output_means_come_from_the_orchestrators_metrics():
    from omni.orchestrator.metrics import OrchestratorMetrics

    m = OrchestratorMetrics()
    m.stage_first_output(1, 0.25)
    before = b.scrape_stage_hist(m.render("fe0") + m.render("fe1"), "first_output")
    assert before == {"1": (0.5, 2.0)}                          # two frontends summed
    m.stage_first_output(1, 0.35)
    m.stage_first_output(2, 0.5)
    m.stage_step(1, 9.0)                                         # another histogram: not counted
    after = b.scrape_stage_hist(m.render("fe0") + m.render("fe1"), "first_output")
    assert b.hist_mean_ms(before, after, ("thinker", "talker", "token2wav")) == {"talker": 350.0, "token2wav": 500.0}
