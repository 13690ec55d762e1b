"""The pure parts of benchmarks/vllm_bench.py (engine args as vLLM flags, ratios, goals) and
benchmarks/latency_trace_report.py over a hand-made trace."""

from __future__ import annotations

import json

from benchmarks import latency_trace_report as tr
from benchmarks import vllm_bench as b


def test_vllm_flags_take_the_stage_engine_args_minus_omnis_own():
    flags = b.vllm_flags({"dtype": "float32", "enforce_eager": True, "num_threads": 1, "max_num_seqs": 8,
                          "enable_prefix_caching": False, "limit_mm_per_prompt": {"audio": 1}})
    assert flags == ["--dtype", "float32", "--enforce-eager", "--limit-mm-per-prompt", '{"audio": 1}',
                     "--max-num-seqs", "8", "--disable-log-stats"]


def result(tput, ttft50, ttft99, itl99):
    return {"output_throughput": tput, "request_throughput": tput / 64, "median_ttft_ms": ttft50,
            "p99_ttft_ms": ttft99, "median_tpot_ms": 50.0, "median_itl_ms": 50.0, "p99_itl_ms": itl99}


def test_ratios_and_goals():
    r = b.ratios(result(80.0, 100.0, 200.0, 60.0), result(79.6, 104.0, 208.0, 66.0))
    assert abs(r["output_throughput"] - 0.995) < 1e-9 and abs(r["median_ttft_delta_ms"] - 4.0) < 1e-9
    assert all(b.goals(r).values())
    r = b.ratios(result(80.0, 100.0, 200.0, 60.0), result(78.0, 106.0, 220.0, 70.0))
    assert not any(b.goals(r).values())
    rounds = [{"ratio": {"x": 1.0}}, {"ratio": {"x": 3.0}}, {"ratio": {"x": 1.2}}]
    assert b.median_ratio(rounds) == {"x": 1.2}


def test_trace_report_joins_hops_per_request(tmp_path):
    def w(name, events):
        (tmp_path / name).write_text("".join(json.dumps(e) + "\n" for e in events))

    # Two tokens of one request; the second's text was held back.
    w("stage0-1.jsonl", [{"t": 0.95, "p": "added", "r": "a", "n": 0},
                         {"t": 1.000, "p": "sent", "r": "a", "n": 1}, {"t": 1.050, "p": "sent", "r": "a", "n": 1},
                         {"t": 0.999, "p": "core", "r": "a", "n": 1, "at": 0.998},
                         {"t": 1.049, "p": "core", "r": "a", "n": 1, "at": 1.047},
                         {"t": 2.0, "p": "gc", "gen": 2, "ms": 5.0}])
    w("frontend0-2.jsonl", [{"t": 0.95, "p": "arrived", "r": "a", "n": 0, "at": 0.94},
                            {"t": 1.001, "p": "recv", "r": "a", "n": 1}, {"t": 1.002, "p": "text", "r": "a", "n": 1},
                            {"t": 1.052, "p": "recv", "r": "a", "n": 1}, {"t": 1.054, "p": "no_text", "r": "a", "n": 1}])
    d = tr.report(str(tmp_path))
    assert d["requests"] == 1 and d["outputs"] == 2 and d["held_back_outputs"] == 1
    hop = d["hops_ms"]["stage sent -> frontend recv"]
    assert hop["n"] == 2 and abs(hop["max"] - 2.0) < 1e-6
    assert abs(d["hops_ms"]["frontend recv -> text"]["max"] - 2.0) < 1e-6
    assert abs(d["hops_ms"]["EngineCore -> stage step done"]["max"] - 2.0) < 1e-6
    assert abs(d["hops_ms"]["EngineCore made -> text"]["max"] - 7.0) < 1e-6   # 1.054 - 1.047
    assert d["gc_pauses_ms"]["stage0 gen2"]["max"] == 5.0
    assert abs(d["hops_ms"]["request in -> entry stage added"]["max"] - 10.0) < 1e-6
    assert abs(d["hops_ms"]["request in -> first text"]["max"] - 62.0) < 1e-6   # 1.002 - 0.94


def test_text_only_deploy_loads_as_the_stage_it_copies(tmp_path):
    """omni_argv's deploy YAML (the thinker stage alone) is a valid omni config with the stage's own
    engine args and sampling defaults."""
    from benchmarks.vllm_bench import OMNI_MODEL, omni_argv
    from omni import config

    argv = omni_argv(str(tmp_path))
    assert argv[-2] == "--deploy-config"
    want = config.load(OMNI_MODEL).stage(0)
    got = config.load(OMNI_MODEL, deploy_config=argv[-1])
    assert len(got.stages) == 1 and got.pipeline.name.endswith("-text")
    assert got.stage(0).engine_args == want.engine_args
    assert got.stage(0).default_sampling_params == want.default_sampling_params
