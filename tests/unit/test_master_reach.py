"""A stage's keep-alive says when its master is gone and when it is back: one WARNING when it becomes
unreachable ("omni master HOST:PORT unreachable ..."), one INFO when it is back; a headless stage whose
head was stopped waited in silence (each failed stream was a DEBUG line)."""

from __future__ import annotations

import logging

from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from tests.unit.master_peers import keep_alive, wait_until

CFG = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}


def lines(caplog, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


def test_a_stopped_master_is_one_warning_and_its_return_another(caplog):
    caplog.set_level(logging.WARNING, logger="omni.master")   # a stage's default --log-level: its return shows
    server = MasterServer(CFG, hash_config(CFG))
    port = server.start()
    client = keep_alive(f"127.0.0.1:{port}", "STAGE", 0, hash_config(CFG))
    restarted = None
    try:
        server.stop()
        wait_until(lambda: lines(caplog, logging.WARNING, "unreachable"), what="no unreachable warning")
        # the keep-alive retries every 0.1-1.5 s: several failed tries, one line
        wait_until(lambda: client.last_error is not None and client.reach.unreachable, what="not retrying")
        restarted = MasterServer(CFG, hash_config(CFG), port=port)
        restarted.start()
        wait_until(lambda: lines(caplog, logging.WARNING, "reachable again"), timeout=20, what="no reachable-again info")
        [warning] = lines(caplog, logging.WARNING, "unreachable")
        assert warning.startswith(f"omni master 127.0.0.1:{port} unreachable (UNAVAILABLE")
        assert "retrying every 1.5 s" in warning
        [info] = lines(caplog, logging.WARNING, "reachable again")
        assert info.startswith(f"omni master 127.0.0.1:{port} reachable again after ")
    finally:
        client.close()
        if restarted is not None:
            restarted.stop()


def test_a_flapping_master_is_rate_limited_and_back_is_said_only_after_a_warning(caplog):
    from omni.master.reach import Reachability

    caplog.set_level(logging.INFO, logger="t")
    reach = Reachability("h:1", logging.getLogger("t"), retry_s=1.5, burst=2)
    reach.back()     # never lost: nothing to say
    for _ in range(4):
        reach.lost("UNAVAILABLE: x")
        reach.lost("UNAVAILABLE: x again")   # the same outage
        reach.back()
    assert len(lines(caplog, logging.WARNING, "unreachable")) == 2
    assert len(lines(caplog, logging.WARNING, "reachable again")) == 2
