"""The master against real client processes on 127.0.0.1 (port 0), waiting on topology events."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omni.errors import BadRequest, ConfigError, Unavailable
from omni.master.auth import TlsFiles
from omni.master.client import AsyncMasterClient, MasterClient
from omni.master.configdiff import hash_config
from omni.master.errors import Unauthenticated
from omni.master.server import MasterServer
from tests.certs import make_certs as _make_certs
from tests.e2e.harness import unused_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("master_client_proc.py")
CFG = {"model": "tiny", "stages": [{"stage_id": 0, "engine_args": {"max_model_len": 2048}},
                                   {"stage_id": 1, "engine_args": {"max_model_len": 2048}}]}
HASH = hash_config(CFG)
CLI = [sys.executable, "-c", "from omni.cli import main; main()"]


class Child:
    """A master_client_proc.py process; its JSON output lines land in a queue."""

    def __init__(self, address: str, stage_id: int, hint: int = -1, token: str | None = None):
        env = {**os.environ, "OMNI_TEST_PIPELINE": json.dumps(CFG), "PYTHONUNBUFFERED": "1"}
        if token:
            env["OMNI_TOKEN"] = token
        self.proc = subprocess.Popen([sys.executable, str(CHILD), address, str(stage_id), str(hint)],
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, key: str, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and self.lines.empty():
                pytest.fail(f"child pid {self.proc.pid} printed no {key!r} line (exit {self.proc.poll()})")
            try:
                msg = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if key in msg:
                return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class Watch:
    """Follows WatchTopology in a thread; wait() blocks until a predicate on the view holds."""

    def __init__(self, client: MasterClient):
        self.view: dict[str, object] = {}
        self.events: queue.Queue = queue.Queue()
        self._it = client.watch(timeout_s=120)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for ev in self._it:
                self.events.put(ev)
        except Exception as e:
            self.events.put(e)

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not pred(self.view):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"timed out after {timeout} s waiting for {what}; view: "
                            f"{ {k: v.state for k, v in self.view.items()} }")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if isinstance(ev, Exception):
                raise ev
            if ev.kind == "SNAPSHOT":
                self.view = {r.replica_id: r for r in ev.replicas}
            for r in ev.replicas if ev.kind != "SNAPSHOT" else ():
                if ev.kind == "REMOVED":
                    self.view.pop(r.replica_id, None)
                else:
                    self.view[r.replica_id] = r
        return self.view

    def state(self, replica_id: str, state: str, timeout: float):
        return self.wait(lambda v: replica_id in v and v[replica_id].state == state, timeout,
                         f"{replica_id} {state}")[replica_id]

    def close(self) -> None:
        self._it.close()


@pytest.fixture
def children():
    made: list[Child] = []
    yield lambda *a, **kw: made.append(Child(*a, **kw)) or made[-1]
    for c in made:
        if c.proc.poll() is None:
            c.kill()


@pytest.fixture
def master():
    server = MasterServer(CFG, HASH, lease_ttl_s=1.0)
    server.start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture
def client(master):
    c = MasterClient(master.address)
    yield c
    c.close()


def test_kill_marks_suspect_at_once_then_dead_then_slot_reused(master, client, children):
    watch = Watch(client)
    a = children(master.address, 1)
    assert a.expect("registered")["registered"] == "s1r0"
    info = watch.state("s1r0", "READY", 10)
    assert info.pid == a.proc.pid and info.endpoints["channel"].startswith("tcp://127.0.0.1:")
    assert info.extra == {"gpu_util": 0.5}
    b = children(master.address, 1)
    assert b.expect("registered")["registered"] == "s1r1"
    watch.state("s1r1", "READY", 10)

    t0 = time.monotonic()
    a.kill()
    watch.state("s1r0", "SUSPECT", 1.0)
    suspect_s = time.monotonic() - t0
    watch.state("s1r0", "DEAD", 3.0)
    dead_s = time.monotonic() - t0
    print(f"SIGKILL -> SUSPECT {suspect_s * 1000:.0f} ms, -> DEAD {dead_s:.2f} s (lease 1 s)")
    st = client.get_status()
    assert [(r.replica_id, r.state) for r in st.replicas] == [("s1r0", "DEAD"), ("s1r1", "READY")]
    assert [(s.stage_id, s.ready_replicas) for s in st.stages] == [(0, 0), (1, 1)]

    c = children(master.address, 1)  # the dead holder's slot is the lowest reusable one
    assert c.expect("registered")["registered"] == "s1r0"
    assert watch.state("s1r0", "READY", 10).pid == c.proc.pid
    watch.close()


def test_master_restart_client_reregisters_same_slot_and_kv_persists(tmp_path, children):
    server = MasterServer(CFG, HASH, lease_ttl_s=1.0, state_dir=str(tmp_path))
    port = server.start()
    try:
        admin = MasterClient(server.address)
        admin.kv_put("voices", "alice", b"\x00wav")
        admin.kv_put("sleep", "state", b'{"level": 1}')
        child = children(server.address, 0, hint=2)  # a fresh slot would be 0: the hint decides
        assert child.expect("registered")["registered"] == "s0r2"
        server.stop(grace=0.2)

        server = MasterServer(CFG, HASH, port=port, lease_ttl_s=1.0, state_dir=str(tmp_path))
        assert server.start() == port
        t0 = time.monotonic()
        again = child.expect("registered", timeout=10)
        assert again == {"registered": "s0r2", "again": True}
        watch = Watch(admin)
        watch.state("s0r2", "READY", 5)
        print(f"master restart -> re-registered and READY in {time.monotonic() - t0:.2f} s")
        assert admin.kv_get("voices", "alice") == b"\x00wav"
        assert admin.kv_list("sleep") == {"state": b'{"level": 1}'}
        assert admin.kv_delete("voices", "alice") and admin.kv_get("voices", "alice") is None
        assert not admin.kv_delete("voices", "alice")
        with pytest.raises(BadRequest, match="bad kv namespace"):
            admin.kv_put("../etc", "k", b"")
        watch.close()
        admin.close()
    finally:
        server.stop(grace=0.2)


def test_a_frontends_topology_keeps_stages_through_a_master_restart(children):
    """The frontend's watch reconnects to the new master before the stages registered again: they stay
    (no REMOVED, no channel closed, no request failed) and are READY again once they did."""
    import asyncio

    from omni.frontend import follow_topology
    from omni.orchestrator.topology import Topology

    server = MasterServer(CFG, HASH, lease_ttl_s=1.0)
    port = server.start()
    stages = [children(server.address, 0), children(server.address, 1)]
    for c in stages:
        c.expect("registered")

    async def main():
        topo, stop, seen = Topology(grace_s=1.0), asyncio.Event(), []
        topo.on_change(lambda r, kind: seen.append((r.replica_id, kind, r.state)))
        task = asyncio.create_task(follow_topology(AsyncMasterClient(f"127.0.0.1:{port}"), topo, stop))
        try:
            while sorted(r.state for r in topo.replicas.values()) != ["READY", "READY"]:
                await asyncio.sleep(0.02)       # polling local state; bounded by the wait_for below
            await asyncio.to_thread(server.stop, 0.2)
            again = MasterServer(CFG, HASH, port=port, lease_ttl_s=1.0)
            again.start()
            try:
                await asyncio.to_thread(lambda: [c.expect("registered", timeout=10) for c in stages])
                await asyncio.sleep(1.5)        # past the grace: nothing is dropped after it either
                assert "REMOVED" not in [k for _, k, _ in seen], seen
                assert {r.replica_id: r.state for r in topo.replicas.values()} == {"s0r0": "READY", "s1r0": "READY"}
                assert topo.expiry_in() is None
            finally:
                again.stop(grace=0.2)
        finally:
            stop.set()
            task.cancel()
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        server.stop(grace=0.2)


def test_send_command_round_trip_with_acks(master, client, children):
    watch = Watch(client)
    s0, s1 = children(master.address, 0), children(master.address, 1)
    watch.state("s0r0", "READY", 10)
    watch.state("s1r0", "READY", 10)

    # Each is the last READY replica of its stage: `omni sleep` (keep_serving) is refused without --force.
    with pytest.raises(ConfigError, match=r"sleep would stop stage 0: s0r0 is its last READY, awake replica; "
                                          r"stage 1: s1r0 .*--force"):
        client.send_command("SLEEP", args={"level": 1}, timeout_s=5, keep_serving=True)
    t0 = time.monotonic()
    results = client.send_command("SLEEP", args={"level": 1}, timeout_s=5)   # as told (--force)
    rtt = time.monotonic() - t0
    assert sorted((r.replica_id, r.ok, r.outcome) for r in results) == [
        ("s0r0", True, "acked"), ("s1r0", True, "acked")]
    assert {r.message for r in results} == {f"SLEEP done by pid {s0.proc.pid}", f"SLEEP done by pid {s1.proc.pid}"}
    assert s0.expect("command") == {"command": "SLEEP", "args": {"level": 1}}
    print(f"SendCommand to 2 replicas, acks back: {rtt * 1000:.0f} ms")
    watch.wait(lambda v: v["s0r0"].is_sleeping and v["s1r0"].is_sleeping, 5, "both sleeping")

    only1 = client.send_command("WAKE_UP", stage_ids=[1], timeout_s=5)
    assert [(r.replica_id, r.ok) for r in only1] == [("s1r0", True)]
    # s0r0 sleeps: it serves nothing already, so draining it stops nothing more.
    drained = client.send_command("DRAIN", replica_ids=["s0r0"], timeout_s=5)
    assert [(r.replica_id, r.ok) for r in drained] == [("s0r0", True)]
    watch.state("s0r0", "DRAINING", 5)
    assert client.send_command("DRAIN", stage_ids=[0], timeout_s=1) == []  # nothing READY left there
    with pytest.raises(ConfigError, match="drain would stop stage 1: s1r0"):
        client.send_command("DRAIN", stage_ids=[1], timeout_s=1, keep_serving=True)
    undrained = client.send_command("UNDRAIN", stage_ids=[0], timeout_s=5)
    assert [(r.replica_id, r.ok) for r in undrained] == [("s0r0", True)]
    watch.state("s0r0", "READY", 5)
    assert client.send_command("UNDRAIN", stage_ids=[0], timeout_s=1) == []   # nothing DRAINING there
    # Heartbeats after the undrain say "not draining": it stays READY.
    hb = watch.wait(lambda v: v["s0r0"].heartbeat_age_s < 0.1 and v["s0r0"].state == "READY", 5, "a heartbeat")
    assert hb["s0r0"].state == "READY"
    client.send_command("DRAIN", replica_ids=["s0r0"], timeout_s=5)
    watch.state("s0r0", "DRAINING", 5)

    with pytest.raises(BadRequest, match=r"stage\(s\) 7 not in the pipeline"):
        client.send_command("SLEEP", stage_ids=[7])
    with pytest.raises(BadRequest, match="unknown command kind 'REBOOT'"):
        client.send_command("REBOOT")

    async def via_asyncio():
        ac = AsyncMasterClient(master.address)
        try:
            res = await ac.send_command("WAKE_UP", stage_ids=[0], replica_ids=[], timeout_s=5)
            st = await ac.get_status()
            await ac.kv_put("jobs", "j1", b"x")
            return res, st, await ac.kv_get("jobs", "j1")
        finally:
            await ac.close()

    import asyncio
    res, st, value = asyncio.run(via_asyncio())
    assert [r.ok for r in res] == [True] and value == b"x"
    assert {r.replica_id: r.state for r in st.replicas} == {"s0r0": "DRAINING", "s1r0": "READY"}

    s1.proc.send_signal(signal.SIGTERM)  # deregisters cleanly
    watch.wait(lambda v: "s1r0" not in v, 5, "s1r0 removed")
    assert s1.proc.wait(10) == 0
    watch.close()


def test_stage_wide_sleep_and_wakeup_report_suspect_and_registering_replicas_as_disconnected():
    """They were skipped: a replica whose stream was down at the SLEEP came back awake unnoticed."""
    server = MasterServer(CFG, HASH, lease_ttl_s=30.0)
    server.start()
    made = [MasterClient(server.address) for _ in range(3)]
    try:
        ready, registering, suspect = made
        for i, c in enumerate(made):
            c.register("STAGE", 0, config_hash=HASH, pid=2000 + i)
        for c in (ready, suspect):
            c.start_keepalive(lambda: {}, lambda cmd: (True, f"{cmd.kind} done"), interval_s=0.1)
        watch = Watch(made[0])
        watch.wait(lambda v: [v[r].state for r in ("s0r0", "s0r2") if r in v] == ["READY"] * 2, 5, "two READY")
        suspect.stop_keepalive()
        watch.state("s0r2", "SUSPECT", 5)
        watch.close()
        for kind in ("SLEEP", "WAKE_UP"):
            results = made[0].send_command(kind, stage_ids=[0], args={"level": 1} if kind == "SLEEP" else None,
                                           timeout_s=2)
            assert [(r.replica_id, r.ok, r.outcome, r.message) for r in results] == [
                ("s0r0", True, "acked", f"{kind} done"),
                ("s0r1", False, "disconnected", "no keep-alive stream (the replica is REGISTERING)"),
                ("s0r2", False, "disconnected", "no keep-alive stream (the replica is SUSPECT)")], kind
    finally:
        for c in made:
            c.close()
        server.stop(grace=0.2)


def test_config_mismatch_refused_with_field_names(master, client):
    other = json.loads(json.dumps(CFG))
    other["stages"][1]["engine_args"]["max_model_len"] = 1024
    with pytest.raises(ConfigError) as e:
        client.register("STAGE", 1, config_hash=hash_config(other), pipeline_config=other)
    assert str(e.value) == ("stage 1 config differs from the master's: "
                            "engine_args.max_model_len: master=2048 replica=1024")
    with pytest.raises(BadRequest, match="stage 4 is not in the pipeline"):
        client.register("STAGE", 4, config_hash=HASH)
    fe = client.register("FRONTEND", config_hash=HASH)
    assert fe.replica_id == "fe0" and fe.pipeline_config == CFG


def test_token_required_on_every_call():
    server = MasterServer(CFG, HASH, token="s3cret")
    server.start()
    try:
        for token in (None, "wrong"):
            bad = MasterClient(server.address, token=token)
            with pytest.raises(Unauthenticated, match="refused the call"):
                bad.get_status()
            with pytest.raises(Unauthenticated):
                bad.register("STAGE", 0, config_hash=HASH)
            with pytest.raises(Unauthenticated):
                next(bad.watch(timeout_s=5))
            bad.close()
        good = MasterClient(server.address, token="s3cret")
        assert good.register("STAGE", 0, config_hash=HASH).replica_id == "s0r0"
        assert next(good.watch(timeout_s=5)).kind == "SNAPSHOT"
        good.close()
    finally:
        server.stop(grace=0.2)


def test_mtls(tmp_path):
    pytest.importorskip("cryptography")
    certs = _make_certs(tmp_path)
    server = MasterServer(CFG, HASH, tls=TlsFiles(certs["server"], certs["server_key"], certs["ca"]))
    server.start()
    try:
        good = MasterClient(server.address, tls=TlsFiles(certs["client"], certs["client_key"], certs["ca"]))
        assert good.get_status().config_hash == HASH
        good.close()
        for tls in (TlsFiles(ca=certs["ca"]), None):  # no client cert / plaintext
            bad = MasterClient(server.address, tls=tls, timeout_s=3)
            with pytest.raises(Unavailable, match=f"cannot reach the omni master at {server.address}"):
                bad.get_status()
            bad.close()
    finally:
        server.stop(grace=0.2)


def _readline(proc: subprocess.Popen, timeout: float = 15.0) -> str:
    """One stdout line of proc, failing after timeout instead of blocking for ever."""
    box: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: box.put(proc.stdout.readline()), daemon=True).start()
    try:
        return box.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no output line from {proc.args} within {timeout} s (exit {proc.poll()})")


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_status_cli_json_table_and_exit_codes(master, client):
    client.register("STAGE", 0, config_hash=HASH, endpoints={"channel": "tcp://127.0.0.1:1"})
    client.start_keepalive(lambda: {"queue_len": 3, "in_flight": 1}, lambda cmd: (True, ""), interval_s=0.2)
    watch = Watch(client)
    watch.state("s0r0", "READY", 5)

    r = _cli("status", "--master", master.address, "--json")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "omni status: stage 1 has no READY replica"
    doc = json.loads(r.stdout)
    assert doc["problems"] == ["stage 1 has no READY replica"] and doc["config_hash"] == HASH
    rep = doc["replicas"][0]
    assert (rep["replica_id"], rep["state"], rep["queue_len"], rep["role"]) == ("s0r0", "READY", 3, "STAGE")

    other = MasterClient(master.address)
    other.register("STAGE", 1, config_hash=HASH)
    other.start_keepalive(lambda: {}, lambda cmd: (True, ""), interval_s=0.2)
    fe = MasterClient(master.address)
    fe.register("FRONTEND", config_hash=HASH)
    fe.start_keepalive(lambda: {"requests_total": 42}, lambda cmd: (True, ""), interval_s=0.2)
    watch.wait(lambda v: all(v.get(k) and v[k].state == "READY" for k in ("s1r0", "fe0")), 5, "all READY")

    r = _cli("status", "--master", master.address)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2].split() == ["STAGE", "REPLICA", "HOST", "PID", "STATE", "QUEUE", "IN-FLIGHT", "HEARTBEAT",
                                "SLEEPING"]
    assert lines[3].split()[:2] == ["0", "s0r0"] and lines[3].split()[4:6] == ["READY", "3"]
    assert any(line.split()[:1] == ["fe0"] and "42" in line.split() for line in lines)
    watch.close()
    for c in (other, fe):
        c.close()


def test_status_cli_unreachable_master_exit_2():
    r = _cli("status", "--master", "127.0.0.1:1", "--json")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("omni status: cannot reach the omni master at 127.0.0.1:1")
    r = _cli("status", "--master", "nonsense")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


def test_master_cli_prints_port_and_stops_on_sigterm():
    proc = subprocess.Popen([*CLI, "master", "--port", "0", "--lease-ttl", "1"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        line = _readline(proc)  # flushed by the command itself
        assert line.startswith("omni master listening on 127.0.0.1:"), line
        address = line.split()[-1]
        r = _cli("status", "--master", address)
        assert r.returncode == 1
        assert "no pipeline config yet" in r.stderr
        c = MasterClient(address)
        assert c.register("STAGE", 1, config_hash=HASH, pipeline_config=CFG).replica_id == "s1r0"  # adopted
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_status_cli_watch_refreshes_on_events_until_ctrl_c(master, client):
    proc = subprocess.Popen([*CLI, "status", "--master", master.address, "--json", "--watch"], cwd=REPO,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    ok = False
    try:
        first = json.loads(_readline(proc))   # printed at the watch's SNAPSHOT: the watch is registered
        assert first["replicas"] == [] and first["problems"] == ["stage 0 has no READY replica",
                                                                 "stage 1 has no READY replica"]
        client.register("STAGE", 0, config_hash=HASH)  # an ADDED event: the watcher prints again
        # Heartbeats: no lease expiry (a DEAD event, another print) falls in the Ctrl-C window.
        client.start_keepalive(lambda: {}, lambda cmd: (True, ""), interval_s=0.1)
        second = json.loads(_readline(proc))
        assert [r["replica_id"] for r in second["replicas"]] == ["s0r0"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 1  # the last view still misses READY replicas
        ok = True
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if not ok:
            print("omni status --watch stderr:\n" + proc.stderr.read())


def test_ctrl_c_during_a_command_ends_the_cli_at_once_saying_so(master, client):
    """SIGINT while `omni drain` waits for a slow ack: the call runs off the main thread, so no
    KeyboardInterrupt is raised inside grpc (whose channel could then hang at close)."""
    got = threading.Event()

    def slow(cmd):
        got.set()
        time.sleep(3)
        return True, ""
    client.register("STAGE", 0, config_hash=HASH)
    client.start_keepalive(lambda: {}, slow, interval_s=0.1)
    watch = Watch(client)
    watch.state("s0r0", "READY", 5)
    watch.close()
    proc = subprocess.Popen([*CLI, "drain", "--master", master.address, "--replica", "s0r0", "--force"], cwd=REPO,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert got.wait(15), "the drain never reached the stage"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)       # the CLI waits for the ack, 3 s away
        assert proc.wait(5) == 130 and time.monotonic() - t0 < 2
        err = proc.stderr.read()
        assert "omni drain: interrupted" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_drain_cli_refuses_the_last_replica_without_force_and_undrain_takes_it_back(master, client, children):
    watch = Watch(client)
    children(master.address, 0)
    children(master.address, 1)
    watch.state("s1r0", "READY", 10)
    refused = _cli("drain", "--master", master.address, "--stage", "1")
    assert refused.returncode == 1, refused.stderr   # refused: 1; 2 is an unreachable master
    assert "drain would stop stage 1: s1r0 is its last READY, awake replica" in refused.stderr
    assert "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert watch.view["s1r0"].state == "READY"
    forced = _cli("drain", "--master", master.address, "--stage", "1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "--force: stage 1 has no awake READY replica now (s1r0)" in forced.stderr
    watch.state("s1r0", "DRAINING", 5)
    back = _cli("undrain", "--master", master.address, "--stage", "1", "--json")
    assert back.returncode == 0, back.stderr
    assert [(r["replica_id"], r["ok"]) for r in json.loads(back.stdout)["results"]] == [("s1r0", True)]
    watch.state("s1r0", "READY", 5)
    nothing = _cli("undrain", "--master", master.address, "--stage", "1")
    assert nothing.returncode == 2 and "no live stage replica matched" in nothing.stderr
    watch.close()


def test_an_undrain_whose_ack_timed_out_leaves_the_replica_ready_once_it_serves(master, client):
    """The stage takes the UNDRAIN after the command's timeout (a long step): the master marked
    nothing, but the stage's heartbeats say it serves, so it is READY again, not DRAINING for good."""
    stage = MasterClient(master.address)
    state = {"draining": False}

    def on_command(cmd):
        if cmd.kind == "UNDRAIN":
            time.sleep(1.0)
        state["draining"] = cmd.kind == "DRAIN"
        return True, "ok"
    try:
        stage.register("STAGE", 0, config_hash=HASH)
        stage.start_keepalive(lambda: dict(state), on_command, interval_s=0.1)
        watch = Watch(client)
        watch.state("s0r0", "READY", 5)
        assert [r.ok for r in client.send_command("DRAIN", replica_ids=["s0r0"])] == [True]
        watch.state("s0r0", "DRAINING", 5)
        late = client.send_command("UNDRAIN", replica_ids=["s0r0"], timeout_s=0.3)
        assert [(r.ok, r.outcome) for r in late] == [(False, "timeout")]
        assert not watch.state("s0r0", "READY", 5).draining
        watch.close()
    finally:
        stage.close()


def test_two_concurrent_keep_serving_drains_cannot_stop_a_stages_last_two_replicas(master, client):
    """Each drain's check saw the other replica still READY (its ack not in yet): both went through
    and the stage had no READY replica. A drain or sleep being sent counts as stopped for the other."""
    stages = []
    try:
        for i in range(2):
            c = MasterClient(master.address)
            c.register("STAGE", 1, config_hash=HASH, pid=1000 + i)
            state = {"draining": False}

            def on_command(cmd, state=state):
                time.sleep(0.3)                       # the stage loop in an engine step
                state["draining"] = cmd.kind == "DRAIN"
                return True, "draining"
            c.start_keepalive(lambda state=state: dict(state), on_command, interval_s=0.1)
            stages.append(c)
        watch = Watch(client)
        watch.wait(lambda v: [r.state for r in v.values() if r.stage_id == 1] == ["READY"] * 2, 5, "both READY")
        out: dict[str, object] = {}

        def drain(rid):
            try:
                out[rid] = [r.ok for r in client.send_command("DRAIN", replica_ids=[rid], keep_serving=True)]
            except ConfigError as e:
                out[rid] = str(e)
        threads = [threading.Thread(target=drain, args=(rid,)) for rid in ("s1r0", "s1r1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        refused = [v for v in out.values() if v != [True]]
        assert len(out) == 2 and len(refused) == 1, out          # one went through, the other was refused
        refused = refused[0]
        assert "drain would stop stage 1" in refused and "a drain or sleep is being sent to it" in refused
        assert [s.ready_replicas for s in client.get_status().stages if s.stage_id == 1] == [1]
        watch.close()
    finally:
        for c in stages:
            c.close()


def test_register_waits_for_a_late_master_and_a_stop_ends_the_wait():
    """register(wait_s, stop): with no master, setting `stop` ends the wait at once (None) and the
    wait's end is an Unavailable naming it; a master that comes up during the wait gets exactly one
    registration (the connection is awaited in slices, the Register call made once)."""
    port = unused_port()                # nothing listens on it until the master below
    address = f"127.0.0.1:{port}"
    kw = dict(config_hash=HASH, pipeline_config=CFG)
    with MasterClient(address) as c:
        stop, out = threading.Event(), queue.Queue()
        t = threading.Thread(target=lambda: out.put(c.register("STAGE", 0, wait_s=60, stop=stop, **kw)))
        t.start()
        stop.set()
        t.join(5)
        assert not t.is_alive() and out.get_nowait() is None
        with pytest.raises(Unavailable, match="no answer within 1.5 s"):
            c.register("STAGE", 0, wait_s=1.5, stop=threading.Event(), **kw)
        t = threading.Thread(target=lambda: out.put(c.register("STAGE", 0, wait_s=60, stop=threading.Event(), **kw)))
        t.start()
        server = MasterServer(CFG, HASH, port=port, lease_ttl_s=5.0)
        server.start()
        try:
            t.join(30)
            reg = out.get_nowait()
            assert reg is not None and reg.lease_ttl_s == 5.0
            assert [r.replica_id for r in c.get_status().replicas] == [reg.replica_id]
        finally:
            server.stop(grace=0.2)
