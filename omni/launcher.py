"""The parent process of `omni serve`: master, stage processes, frontends, supervision.

Single-command mode runs everything here; head mode (--stage-id 0) runs the master,
stage 0 (none with --num-replicas 0) and the frontends and waits for the other stages; headless mode with several
replicas runs those replicas. Children are real processes started from this same
package; they die with the parent (PR_SET_PDEATHSIG) so nothing is orphaned.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni.api.limits import HttpLimits
from omni.backoff import RestartBackoff
from omni.config import DeployConfig
from omni.errors import OmniError
from omni.fsutil import OWNER_FILE, sweep_stale_tmp
from omni.netaddr import host_port
from omni.signals import StopRequest
from omni.vllm_omni_flags import Orchestration

if TYPE_CHECKING:
    from omni.master.auth import TlsFiles

logger = logging.getLogger(__name__)

# Lines of a stage's own engine processes (vLLM prefixes "(EngineCore pid=N) ", "(Worker pid=N) ").
ENGINE_LINE = re.compile(r"\([\w.-]+ pid=\d+\) ")


def progress(msg: str) -> None:
    try:
        print(f"omni: {msg}", file=sys.stderr, flush=True)
    except OSError:
        pass   # our stderr is gone (a closed pipe): shutdown must still run to its end


@dataclass
class Child:
    name: str
    kind: str                 # "stage" | "frontend"
    argv: list[str]
    stage_id: int = -1
    index: int = 0
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    restarts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    env: dict | None = None
    pass_fds: tuple[int, ...] = ()
    instance_id: str = ""     # what this start of it registers under (envs.OMNI_INSTANCE_ID)

    def start(self) -> None:
        # Own process group: a terminal's Ctrl-C reaches the parent only, which then
        # stops the children in order. No preexec_fn, so no fork() under gRPC's threads.
        self.instance_id = uuid.uuid4().hex
        env = {**(os.environ if self.env is None else self.env), "OMNI_INSTANCE_ID": self.instance_id}
        self.proc = subprocess.Popen(
            self.argv + ["--parent-pid", str(os.getpid())], stderr=subprocess.PIPE, env=env,
            process_group=0, text=True, errors="replace", bufsize=1, pass_fds=self.pass_fds,
        )
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True,
                         name=f"omni-log-{self.name}").start()
        self.backoff.started()

    def _pump(self, proc: subprocess.Popen) -> None:
        # Reads to EOF whatever happens to our stderr: a child whose pipe nobody drains
        # blocks in its next log write once the pipe is full.
        echo = True
        for line in proc.stderr:
            if not ENGINE_LINE.match(line):   # the cause quoted for this child is its own words
                self.tail.append(line.rstrip())
            if echo:
                try:
                    sys.stderr.write(f"[{self.name}] {line}")
                except (OSError, ValueError):   # broken pipe, closed stream: drop the output
                    echo = False
        if echo:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sweep(self) -> None:
        """Once the child is gone: kill what is left of its process group (an engine process
        that outlived it; the group id stays taken while any member lives, so it names no
        stranger), then remove the temp folders it owned (a vLLM stage's ipc sockets and FileStore)."""
        if self.proc is not None and self.proc.poll() is not None:
            from omni.proctree import kill_group

            if kill_group(self.proc.pid):
                logger.info("%s: killed what was left of its process group", self.name)
            sweep_stale_tmp(owner=self.proc.pid)

    def exit_cause(self, when: str = "") -> str:
        """How it ended: a signal names itself (older output would be stale), else its last words."""
        code, when = self.proc.returncode, f" {when}" if when else ""
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}{when}"
            except ValueError:
                return f"was killed by signal {-code}{when}"
        return f"exited{when} with code {code}: {self.last_words()}"

    def last_words(self) -> str:
        for line in reversed(self.tail):
            if line.startswith("omni:") or "Error" in line:
                return line
        return self.tail[-1] if self.tail else "(no output)"


@dataclass
class LaunchPlan:
    config: DeployConfig
    stages: list[int]                      # stages to run here (all replicas of each)
    master_host: str = "127.0.0.1"
    master_port: int = 0
    host_master: bool = True               # embed the master in this process
    api_server_count: int = 1
    host: str = "127.0.0.1"
    port: int = 8091
    token: str = ""
    api_keys: list[str] = field(default_factory=list)   # --api-key: any one of them opens /v1
    control_api_key: str | None = None     # guards /v1/omni/sleep and /wakeup with a key of their own
    control_routes: bool = True            # False: those routes answer 403
    served_model_names: list[str] = field(default_factory=list)   # the first is reported; none: the model
    replica_address: str | None = None
    num_replicas: int | None = None        # override for the local stages
    engine_flags: dict = field(default_factory=dict)
    log_level: str = "WARNING"
    state_dir: str | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)   # the frontends' body cap, timeouts, backlog
    orchestration: Orchestration = field(default_factory=Orchestration)   # vllm-omni's timeouts, over the config's
    master_tls: TlsFiles | None = None     # the hosted master's certificate (its ca: mTLS)
    client_tls: TlsFiles | None = None     # how this process and its children connect to the master


class Launcher:
    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.children: list[Child] = []
        self.master = None
        self.master_address = host_port(plan.master_host, plan.master_port)
        self._stop = StopRequest()   # set by the signal handlers: no locks there
        self._listener: socket.socket | None = None
        sweep_stale_tmp()
        self._tmp = tempfile.TemporaryDirectory(prefix="omni-")
        with open(os.path.join(self._tmp.name, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        self.http_port: int | None = None
        self._runfile = None

    # ------------------------------------------------------------ building

    def _config_file(self) -> str:
        path = os.path.join(self._tmp.name, "config.json")
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump(self.plan.config.to_dict(), f)
        return path

    def _child_argv(self, role: str, *args: str) -> list[str]:
        tls = self.plan.client_tls.argv() if self.plan.client_tls else []   # paths: each child reads the files
        return [sys.executable, "-m", "omni.children", role, "--config", self._config_file(),
                "--master", self.master_address, "--log-level", self.plan.log_level, *tls, *args]

    def _plan_children(self) -> None:
        p = self.plan
        # The token goes by environment, not argv (argv is world-readable in ps).
        env = {**os.environ, "OMNI_TOKEN": p.token} if p.token else None
        for stage_id in p.stages:
            stage = p.config.stage(stage_id)
            count = p.num_replicas or stage.num_replicas
            for r in range(count):
                # The child waits for the master as long as this launcher waits for it (not its own 120 s).
                args = ["--stage-id", str(stage_id), "--replica-hint", str(r),
                        "--register-wait-s", str(self._startup_timeout_s())]
                if p.replica_address:
                    args += ["--replica-address", p.replica_address]
                if p.engine_flags:
                    args += ["--engine-flags", json.dumps(p.engine_flags)]
                name = f"stage{stage_id}" + (f".{r}" if count > 1 else "") + (f"-{stage.name}" if stage.name else "")
                # The stage's `env` from the interpreter's start (run_stage sets it again, for --headless).
                senv = {**(env or os.environ), **stage.env} if stage.env else env
                self.children.append(Child(name, "stage", self._child_argv("stage", *args), stage_id=stage_id,
                                           index=r, env=senv))
        if p.api_server_count:
            if self._listener is None:
                self._listener = self._bind_http()
            # Job results: one directory every frontend reads; kept with --state-dir, else removed at exit.
            jobs_dir = os.path.join(p.state_dir or self._tmp.name, "jobs")
            fenv = {**(env or os.environ), "OMNI_CONTROL_ROUTES": "on" if p.control_routes else "off"}
            if p.control_api_key:
                fenv["OMNI_CONTROL_API_KEY"] = p.control_api_key
            # Secrets by environment, never argv; a JSON list holds any key (spaces, newlines) unchanged.
            fenv["OMNI_API_KEYS"] = json.dumps(p.api_keys)
            os.makedirs(jobs_dir, mode=0o700, exist_ok=True)
            os.chmod(jobs_dir, 0o700)   # the results are the users' (an older omni made it 0755), as kv/ is
            for i in range(p.api_server_count):
                args = ["--index", str(i), "--host", p.host, "--port", str(self.http_port),
                        *(f"--served-model-name={n}" for n in p.served_model_names or [p.config.model]),
                        "--jobs-dir", jobs_dir,
                        "--listen-fd", str(self._listener.fileno()),
                        "--http-limits", json.dumps(p.http_limits.to_dict())]
                if p.engine_flags.get("max_model_len"):   # the head's stage 0 context, not the deploy's
                    args += ["--max-model-len", str(p.engine_flags["max_model_len"])]
                self.children.append(Child(f"api{i}", "frontend", self._child_argv("frontend", *args),
                                           index=i, env=fenv, pass_fds=(self._listener.fileno(),)))

    def _bind_http(self) -> socket.socket:
        """The one HTTP listening socket (port 0: the kernel's pick, read back), handed to
        every frontend by fd; they all accept from it. No SO_REUSEPORT: a port someone
        else holds (another omni included) is refused, and nobody can join ours."""
        from omni.api.serve import bind_socket

        try:
            sock = bind_socket(self.plan.host, self.plan.port, backlog=self.plan.http_limits.backlog)
        except OSError as e:
            raise OmniError(f"--port {self.plan.port}: cannot listen on {self.plan.host}:{self.plan.port}: "
                            f"{e.strerror}") from None
        self.http_port = sock.getsockname()[1]
        return sock

    # ------------------------------------------------------------ running

    def start_master(self) -> None:
        from omni.master.server import MasterServer

        p = self.plan
        self.master = MasterServer(p.config.to_dict(), p.config.config_hash(), host=p.master_host,
                                   port=p.master_port, token=p.token or None, tls=p.master_tls,
                                   lease_ttl_s=p.orchestration.lease_ttl_s or p.config.pipeline.lease_ttl_s,
                                   state_dir=p.state_dir)
        port = self.master.start()
        self.master_address = host_port(p.master_host, port)
        progress(f"master listening on {self.master_address}" + (" (TLS)" if p.master_tls else ""))
        if p.master_tls:
            self._check_own_master()

    def _check_own_master(self) -> None:
        """The children connect as this process does: a certificate they cannot use fails the start now,
        not at the start-up deadline."""
        from omni.master.auth import TlsRefused
        from omni.master.errors import ClosedByMaster

        try:
            self._status()
        except OmniError as e:
            if not isinstance(e, (TlsRefused, ClosedByMaster)):
                logger.info("own master not answering yet: %s", e)   # a loaded host: the wait retries
                return
            mtls = (" Under mTLS (--tls-ca) they present --tls-cert, which then needs the clientAuth key usage "
                    "besides serverAuth.") if self.plan.master_tls.ca and not isinstance(e, TlsRefused) else ""
            raise OmniError(f"this host's processes cannot connect to its TLS master: {e}.{mtls}") from None

    def run(self) -> int:
        self._stop.install()
        try:
            if self.plan.api_server_count:
                self._listener = self._bind_http()   # first: a taken port fails before anything starts
            if self.plan.host_master:
                self.start_master()
            self._plan_children()
            if self.plan.host_master:   # so a bare `omni status` on this host finds it
                from omni import runfile

                http = host_port(self.plan.host, self.http_port) if self.http_port is not None else None
                tls = self.plan.client_tls
                self._runfile = runfile.write(self.master_address, self.plan.config.model, http,
                                              tls=None if tls is None else {"cert": tls.cert, "key": tls.key, "ca": tls.ca})
            for child in self.children:
                if child.kind == "stage":
                    child.start()
            if not self._wait_ready():
                return self._stopped_in_start_up()
            for child in self.children:
                if child.kind == "frontend":
                    child.start()
            if self.plan.api_server_count and not self._wait_frontends():
                return self._stopped_in_start_up()
            if self.http_port is not None:
                progress(f"serving {(self.plan.served_model_names or [self.plan.config.model])[0]} on "
                         f"http://{host_port(self.plan.host, self.http_port)} "
                         f"({self.plan.api_server_count} API frontend(s)); Ctrl-C stops")
            return self._supervise()
        except OmniError as e:
            progress(f"error: {e}")
            return 1
        finally:
            self.shutdown()

    def _stopped_in_start_up(self) -> int:
        """A stop asked for during start-up (Ctrl-C, SIGTERM, SIGHUP) is a clean end, as one while serving
        is: 0. A start-up that failed: 1."""
        if not self._stop.is_set():
            return 1
        progress("stopped during start-up; shutting down")
        return 0

    def _status(self):
        from omni.master.client import MasterClient

        with MasterClient(self.master_address, token=self.plan.token or None, tls=self.plan.client_tls,
                          timeout_s=5.0) as c:
            return c.get_status()

    def _startup_timeout_s(self) -> float:
        return self.plan.orchestration.startup_timeout_s or self.plan.config.pipeline.startup_timeout_s

    def _wait_ready(self) -> bool:
        """Every stage has a READY replica (a launcher without the master: each of its own stages), or the
        deadline passes, or a child dies. A headless group does not wait for the other hosts' stages: its
        replicas serve once registered, and stopping them for another stage's delay would be wrong."""
        from omni.master.errors import Unauthenticated

        stages = self.plan.config.stages if self.plan.host_master else [
            self.plan.config.stage(s) for s in self.plan.stages]
        deadline = time.monotonic() + self._startup_timeout_s()
        last_report = 0.0
        while not self._stop.is_set():
            for child in self.children:
                if child.kind == "stage" and child.proc is not None and child.proc.poll() is not None:
                    child.sweep()
                    progress(f"{child.name} {child.exit_cause('during start-up')}")
                    return False
            try:
                status = self._status()
                ready = {s.stage_id for s in status.stages if s.ready_replicas > 0} if status.has_config else set()
            except Unauthenticated as e:   # no retry makes a wrong token right
                progress(f"error: {e}")
                return False
            except OmniError as e:
                # A loaded machine can make even our own master miss a 5 s call: retry until the deadline.
                ready = set()
                logger.info("master not answering yet: %s", e)
            missing = [s for s in stages if s.stage_id not in ready]
            if not missing:
                return True
            now = time.monotonic()
            if now > deadline:
                progress("start-up deadline passed; still waiting for " +
                         ", ".join(s.label for s in missing))
                return False
            if now - last_report > 5.0:
                last_report = now
                progress("waiting for " + ", ".join(s.label for s in missing))
            self._stop.wait(0.2)
        return False

    def _wait_frontends(self) -> bool:
        deadline = time.monotonic() + 120
        want = self.plan.api_server_count
        while not self._stop.is_set() and time.monotonic() < deadline:
            for child in self.children:
                if child.kind == "frontend" and child.proc.poll() is not None:
                    child.sweep()
                    progress(f"{child.name} {child.exit_cause('during start-up')}")
                    return False
            try:
                status = self._status()
            except OmniError as e:
                logger.info("master not answering yet: %s", e)
                self._stop.wait(0.2)
                continue
            n = sum(1 for r in status.replicas if r.role == "FRONTEND" and r.state == "READY")
            if n >= want:
                return True
            self._stop.wait(0.2)
        if not self._stop.is_set():
            progress("API frontends did not become ready within 120 s")
        return False

    def _supervise(self) -> int:
        while not self._stop.wait(0.5):
            for child in self.children:
                if child.alive():
                    continue
                if child.kind == "frontend":
                    # A crashed frontend is replaced, later each time it dies soon again; the engines carry on.
                    if not child.backoff.waiting():
                        child.sweep()
                        self._exited(child)
                        progress(f"{child.name} {child.exit_cause()}; restarting it in {child.backoff.died():g} s")
                    elif child.backoff.due():
                        child.restarts += 1
                        child.start()
                    continue
                child.sweep()
                self._exited(child)   # DEAD now; its requests already moved when its stream broke (SUSPECT)
                code = child.proc.returncode
                alive = [c for c in self.children if c.kind == "stage" and c.stage_id == child.stage_id and c.alive()]
                if alive:
                    progress(f"{child.name} exited with code {code}; {len(alive)} replica(s) of stage "
                             f"{child.stage_id} remain")
                    self.children.remove(child)
                    break
                progress(f"{child.name} {child.exit_cause()}; no replica of stage {child.stage_id} "
                         f"is left; shutting down")
                return 1
        drain = self.plan.http_limits.shutdown_timeout if self.plan.api_server_count else None
        progress("shutting down" + (f"; in-flight requests may take up to {drain} s (--shutdown-timeout)" if drain else ""))
        return 0

    def _exited(self, child: Child) -> None:
        """Our master marks the reaped child DEAD now, not a lease TTL later: a frontend restarted within the TTL
        found fe{index} still SUSPECT and took the next free index for good (its jobs read frontend_gone and its
        metrics drop now); a stage replica stayed SUSPECT in `omni status` and its slot held."""
        if self.master is None or child.proc is None:
            return
        from omni.master.registry import Role
        from omni.stage.main import advertised_host, replica_host   # the host it registered under

        if child.kind == "frontend":
            role, host = Role.FRONTEND, advertised_host(self.plan.host, self.master_address)
        else:
            role, host = Role.STAGE, replica_host(self.plan.replica_address, self.master_address)
        gone = self.master.process_exited(host, child.proc.pid, role, child.instance_id)
        logger.info("%s (pid %d): marked DEAD in the master: %s", child.name, child.proc.pid, gone or "no entry")

    def shutdown(self, grace_s: float = 10.0) -> None:
        # Frontends first (stop taking requests; their in-flight ones run on for --shutdown-timeout while the
        # stages serve them), then stages, then the master. A stop request that comes while this runs (a
        # second Ctrl-C) ends the grace: every child's process group is killed now. Our copy of the listener
        # closes first: once the frontends close theirs, new connections are refused, not left queued.
        asked = self._stop.count
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for kind in ("frontend", "stage"):
            group = [c for c in self.children if c.kind == kind and c.alive()]
            for c in group:
                c.proc.send_signal(signal.SIGTERM)
            drain = self.plan.http_limits.shutdown_timeout if kind == "frontend" else None
            deadline = time.monotonic() + grace_s + (drain or 0)
            for c in group:
                if not self._wait_child(c, deadline, asked):
                    if self._stop.count > asked:
                        break
                    progress(f"{c.name} did not stop within {grace_s + (drain or 0):.0f} s; killing it")
                    c.proc.kill()
                    c.proc.wait()
            if self._stop.count > asked:
                self._kill_all()
                break
            for c in group:
                c.sweep()
        if self.master is not None:
            self.master.stop(grace=1.0)
            self.master = None
        if self._runfile is not None:
            from omni import runfile

            runfile.remove(self._runfile)
            self._runfile = None
        self._tmp.cleanup()

    def _wait_child(self, c: Child, deadline: float, asked: int) -> bool:
        """True once `c` exited; False at the deadline or on a new stop request (sliced, so one is seen)."""
        while self._stop.count == asked:
            try:
                c.proc.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                return True
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return False
        return c.proc.poll() is not None

    def _kill_all(self) -> None:
        from omni.proctree import kill_group

        progress("second stop request: killing every child now")
        for c in self.children:
            if c.proc is not None:
                kill_group(c.proc.pid)   # the resource tracker last, so it still unlinks their shm
                c.proc.wait()
