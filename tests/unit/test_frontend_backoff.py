"""A frontend that keeps dying is restarted later each time (0.5 s doubling to 30 s, back to 0.5 s after a
60 s run), and its restart line says how it ended as a stage's does (exit_cause: signal or last words)."""

from __future__ import annotations

import sys
from pathlib import Path

from omni import config as cfg
from omni.backoff import RestartBackoff
from omni.launcher import Child, LaunchPlan, Launcher


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_delay_doubles_to_the_cap_and_resets_after_a_long_run():
    clock = Clock()
    b = RestartBackoff(clock=clock)
    delays = []
    for _ in range(9):
        b.started()
        clock.t += 1.0          # dies 1 s after each start
        delays.append(b.died())
        assert not b.due()
        clock.t += delays[-1]
        assert b.due()
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    b.started()
    clock.t += 60.0             # a run of a minute: the next crash is a new first one
    assert b.died() == 0.5


def test_the_supervisor_restarts_a_crashing_frontend_with_backoff(capsys):
    clock = Clock()
    launcher = Launcher(LaunchPlan(cfg.load("smollm2"), stages=[0], host_master=False, api_server_count=0))
    crash = [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]   # a signal: no race with the log pump
    child = Child("api0", "frontend", crash, backoff=RestartBackoff(clock=clock))
    launcher.children.append(child)
    child.start()
    ticks = []

    def tick(timeout=None):     # the supervisor's 0.5 s wait: the clock moves, the crashed child is gone
        child.proc.wait()
        clock.t += 0.5
        ticks.append(clock.t)
        return len(ticks) > 20  # 10 s of supervision
    launcher._stop.wait = tick
    try:
        assert launcher._supervise() == 0
    finally:
        launcher.shutdown()
    # Restarts 0.5, 1, 2 and 4 s after each death (each check on a 0.5 s tick): 4 within 10 s, not 20.
    assert child.restarts == 4
    err = capsys.readouterr().err
    assert "api0 was killed by SIGKILL; restarting it in 0.5 s" in err
    assert "restarting it in 4 s" in err


ROOT = str(Path(__file__).resolve().parents[2])
PEER = """
import os, sys, time
sys.path.insert(0, sys.argv[5])
from tests.unit.master_peers import keep_alive
keep_alive(sys.argv[1], sys.argv[3], int(sys.argv[4]), sys.argv[2], host="127.0.0.1", pid=os.getpid(), replica_hint=0)
time.sleep(60)
"""


def reaped(role: str, stage_id: int, kind: str, name: str):
    """A launcher with its master and one child of `kind` registered as `role` (READY), SIGKILLed and reaped;
    one supervision pass run: (launcher, admin client, the child's pid, what _supervise returned)."""
    import os
    import signal

    from omni.master.client import MasterClient
    from tests.unit.master_peers import wait_until

    plan = LaunchPlan(cfg.load("smollm2"), stages=[], api_server_count=0)
    launcher = Launcher(plan)
    launcher.start_master()
    child = Child(name, kind, [sys.executable, "-c", PEER, launcher.master_address, plan.config.config_hash(), role,
                               str(stage_id), ROOT], stage_id=stage_id, index=0)
    launcher.children.append(child)
    admin = MasterClient(launcher.master_address)
    child.start()
    wait_until(lambda: [r.state for r in admin.get_status().replicas] == ["READY"] or not child.alive(),
               timeout=30, what="the child did not register")
    assert child.alive()
    pid = child.proc.pid
    os.kill(pid, signal.SIGKILL)
    child.proc.wait()
    ticks = []
    launcher._stop.wait = lambda timeout=None: ticks.append(1) or len(ticks) > 1   # one supervision pass
    return launcher, admin, pid, launcher._supervise()


def test_a_reaped_frontend_is_dead_in_the_master_at_once_so_its_restart_is_fe_index_again():
    """Restarted within the lease TTL, a frontend found fe0 still READY/SUSPECT and registered as fe2 for
    good (omni status then no longer matched X-Omni-Frontend); its jobs read in_progress for a lease."""
    from omni.master.client import MasterClient

    launcher, admin, pid, code = reaped("FRONTEND", -1, "frontend", "api0")
    try:
        assert code == 0
        assert [(r.replica_id, r.state, r.pid) for r in admin.get_status().replicas] == [("fe0", "DEAD", pid)]
        new = MasterClient(launcher.master_address)
        try:
            reg = new.register("FRONTEND", -1, config_hash=launcher.plan.config.config_hash(), host="127.0.0.1",
                               pid=pid + 1, replica_hint=0)
            assert reg.replica_id == "fe0"
        finally:
            new.close()
    finally:
        admin.close()
        launcher.shutdown()


def test_a_reaped_stage_replica_is_dead_in_the_master_at_once():
    """The launcher marked only reaped frontends: a reaped stage replica stayed SUSPECT for a lease TTL."""
    launcher, admin, pid, code = reaped("STAGE", 0, "stage", "stage0")
    try:
        assert code == 1   # its stage's last replica: the launcher shuts down
        assert [(r.replica_id, r.state, r.pid) for r in admin.get_status().replicas] == [("s0r0", "DEAD", pid)]
    finally:
        admin.close()
        launcher.shutdown()
