"""The launcher's start-up wait: a headless group (no master here) waits for its own stages only, so its
healthy replicas are not stopped because another host's stage is late; a refused token ends the wait at once."""

from __future__ import annotations

import time

import pytest

from omni import config as cfg
from omni.launcher import LaunchPlan, Launcher
from omni.master.errors import Unauthenticated
from omni.master.types import StageStatus, Status
from omni.vllm_omni_flags import Orchestration

ONLY_STAGE_1_READY = Status(replicas=[], stages=[StageStatus(0, 0, 0), StageStatus(1, 2, 2), StageStatus(2, 0, 0)],
                            config_hash="h", has_config=True, lease_ttl_s=5.0, pipeline_config={})


@pytest.fixture
def launcher(monkeypatch):
    made = []

    def make(host_master: bool, status, timeout_s: float = 0.5) -> Launcher:
        plan = LaunchPlan(cfg.load("smollm2"), stages=[1], host_master=host_master, api_server_count=0,
                          orchestration=Orchestration(startup_timeout_s=timeout_s))
        launcher = Launcher(plan)
        monkeypatch.setattr(launcher, "_status", status)
        made.append(launcher)
        return launcher
    yield make
    for launcher in made:
        launcher.shutdown()


def test_a_headless_group_waits_for_its_own_stages_only(launcher):
    assert launcher(False, lambda: ONLY_STAGE_1_READY)._wait_ready()


def test_a_launcher_with_the_master_waits_for_every_stage(launcher):
    assert not launcher(True, lambda: ONLY_STAGE_1_READY)._wait_ready()


def test_a_refused_token_ends_the_wait_at_once(launcher, capsys):
    def refused():
        raise Unauthenticated("omni master at 127.0.0.1:1 refused the call: missing or wrong omni token")

    t0 = time.monotonic()
    assert not launcher(False, refused, timeout_s=60)._wait_ready()
    assert time.monotonic() - t0 < 5
    assert "missing or wrong omni token" in capsys.readouterr().err


def test_stage_children_wait_for_the_master_as_long_as_the_launcher(launcher, monkeypatch):
    """A headless group's stage children (--num-replicas) wait for a late master until the launcher's own
    start-up deadline (--init-timeout), not a fixed 120 s of their own."""
    from omni import children
    from omni.stage import main as stage_main

    group = launcher(False, lambda: ONLY_STAGE_1_READY, timeout_s=900)
    group._plan_children()
    argv = next(c.argv for c in group.children if c.kind == "stage")
    seen = []
    monkeypatch.setattr(stage_main, "run_stage", lambda config, stage_id, opts, engine_flags: seen.append(opts))
    children.main(argv[argv.index("omni.children") + 1:])
    assert seen and seen[0].register_wait_s == 900
