"""Warnings a peer can trigger at will are rate limited."""

import logging

from omni.ratelog import RateLimitedLog


def test_at_most_burst_lines_per_period_then_the_count_of_dropped_ones(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("omni.ratelog.time.monotonic", lambda: now[0])
    log = RateLimitedLog(logging.getLogger("omni.test.ratelog"), burst=3, period_s=60)
    with caplog.at_level(logging.WARNING, logger="omni.test.ratelog"):
        for i in range(1000):
            log.warning("bad frame %d", i)
        assert [r.getMessage() for r in caplog.records] == ["bad frame 0", "bad frame 1", "bad frame 2"]
        now[0] += 61
        log.warning("bad frame %d", 1000)
    assert caplog.records[-1].getMessage() == "bad frame 1000 (997 similar line(s) dropped)"
