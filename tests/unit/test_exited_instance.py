"""A reaped child is marked DEAD by the id its launcher gave it (OMNI_INSTANCE_ID), not by host and pid:
two containers on one host address (host networking, own pid namespaces) can each run a stage replica
under the same pid, and the launcher's reap of its own marked the other container's live replica DEAD."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest

from omni import config as cfg
from omni import envs
from omni.errors import ConfigError
from omni.launcher import Child, LaunchPlan, Launcher
from omni.master.client import MasterClient
from omni.master.registry import Load, ReplicaState as S, Role
from tests.unit.master_peers import keep_alive, wait_until
from tests.unit.test_frontend_backoff import PEER, ROOT
from tests.unit.test_registry import clock, kinds, reg, stage  # noqa: F401 (fixtures)

MINE, THEIRS = "a" * 32, "b" * 32


def twins(reg):
    mine, _ = reg.register(dataclasses.replace(stage(pid=7), instance_id=MINE))
    theirs, _ = reg.register(dataclasses.replace(stage(pid=7), instance_id=THEIRS))
    for r in (mine, theirs):
        reg.heartbeat(r.lease_id, Load())
    return mine, theirs


def test_exited_marks_only_the_entries_of_that_instance(reg):
    mine, theirs = twins(reg)
    assert kinds(reg.exited(Role.STAGE, "h1", 7, MINE)) == [("UPDATED", mine.replica_id, S.DEAD)]
    assert theirs.state is S.READY


def test_exited_without_an_instance_marks_none_where_two_processes_share_host_and_pid(reg):
    mine, theirs = twins(reg)
    assert reg.exited(Role.STAGE, "h1", 7) == []
    assert (mine.state, theirs.state) == (S.READY, S.READY)


def test_a_bad_instance_id_in_the_environment_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("OMNI_INSTANCE_ID", "not-hex")
    with pytest.raises(ConfigError, match="OMNI_INSTANCE_ID='not-hex': expected 32 lowercase hex digits"):
        MasterClient("127.0.0.1:1")   # the client reads it
    monkeypatch.setenv("OMNI_INSTANCE_ID", MINE)
    assert envs.OMNI_INSTANCE_ID == MINE


def test_the_launcher_marks_its_reaped_replica_dead_and_spares_another_containers_under_that_pid():
    plan = LaunchPlan(cfg.load("smollm2"), stages=[], api_server_count=0)
    launcher = Launcher(plan)
    launcher.start_master()
    child = Child("stage0", "stage", [sys.executable, "-c", PEER, launcher.master_address, plan.config.config_hash(),
                                      "STAGE", "0", ROOT], stage_id=0, index=0)
    launcher.children.append(child)
    admin = MasterClient(launcher.master_address)
    twin = None
    try:
        child.start()
        wait_until(lambda: [r.state for r in admin.get_status().replicas] == ["READY"] or not child.alive(),
                   timeout=30, what="the child did not register")
        pid = child.proc.pid
        # Another container's replica of stage 0 on this host address, whose pid is the same number.
        twin = keep_alive(launcher.master_address, "STAGE", 0, plan.config.config_hash(), host="127.0.0.1", pid=pid)
        wait_until(lambda: [r.state for r in admin.get_status().replicas] == ["READY", "READY"],
                   what="the twin never READY")
        os.kill(pid, signal.SIGKILL)
        child.proc.wait()
        ticks = []
        launcher._stop.wait = lambda timeout=None: ticks.append(1) or len(ticks) > 1   # one supervision pass
        launcher._supervise()
        got = sorted((r.replica_id, r.pid, r.state) for r in admin.get_status().replicas)
        assert got == [("s0r0", pid, "DEAD"), ("s0r1", pid, "READY")], got
    finally:
        if twin is not None:
            twin.close()
        admin.close()
        launcher.shutdown()
