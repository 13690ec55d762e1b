"""benchmarks/stats.pct, the one percentile every benchmark table reports, and the reports that use it."""

from __future__ import annotations

import pytest

from benchmarks import latency_trace_report as tr
from benchmarks import stage_channel as sc
from benchmarks.stats import pct


def test_the_median_for_p50_and_the_nearest_rank_else():
    assert pct([2, 1], 0.5) == 1.5 and pct([1, 2, 3], 0.5) == 2
    xs = list(range(1, 101))
    assert (pct(xs, 0.9), pct(xs, 0.99), pct(xs, 0.0), pct(xs, 1.0)) == (90, 99, 1, 100)
    with pytest.raises(ValueError):
        pct([], 0.5)


def test_the_latency_trace_report_is_not_one_rank_high():
    assert tr.summary([1.0, 2.0]) == {"n": 2, "p50": 1.5, "p90": 2.0, "p99": 2.0, "max": 2.0}
    s = tr.summary([float(x) for x in range(1, 11)])
    assert (s["p50"], s["p90"], s["p99"]) == (5.5, 9.0, 10.0)


def test_the_stage_channel_table_is_not_one_rank_high():
    xs = [k * 1e-6 for k in range(1, 11)]
    (row,) = sc.table({("ping", "zmq"): xs}, {("ping", "zmq"): [1e-5, 2e-5]})
    assert (row["p50_us"], row["p99_us"], row["mean_us"]) == (5.5, 10.0, 5.5)
    assert (row["frontend_cpu_us"], row["stage_cpu_us"]) == (1.0, 2.0)
