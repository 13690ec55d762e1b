"""`omni master` and `omni status`: plain functions with typer.Option defaults (cli.py mounts them)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import msgspec
import typer

from omni.errors import ConfigError, OmniError
from omni.master import DEFAULT_PORT
from omni.master.auth import TlsFiles, refuse_open_master, tls_from_options
from omni.master.types import Status
from omni.signals import StopRequest

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_NOT_READY, EXIT_UNREACHABLE = 0, 1, 2
EXIT_INTERRUPTED = 130     # Ctrl-C, as a shell reports it

T = TypeVar("T")

_TOKEN_HELP = "Shared secret: every call must carry it (env OMNI_TOKEN)."
_MASTER_HELP = "The omni master's HOST:PORT."


def master(
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to listen on (0.0.0.0 for every interface; beyond loopback: needs --omni-token)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on; 0 picks a free one (printed)."),
    omni_token: str | None = typer.Option(None, "--omni-token", envvar="OMNI_TOKEN", help=_TOKEN_HELP),
    lease_ttl: float = typer.Option(5.0, "--lease-ttl", min=0.1,
                                    help="Seconds without a heartbeat before a replica is DEAD."),
    state_dir: str | None = typer.Option(None, "--state-dir",
                                         help="Folder to persist the shared key-value state in (reloaded at start)."),
    tls_cert: str | None = typer.Option(None, "--tls-cert", help="PEM server certificate (enables TLS)."),
    tls_key: str | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    tls_ca: str | None = typer.Option(None, "--tls-ca", help="PEM CA bundle; when given, clients need certs (mTLS)."),
    deploy_config: str | None = typer.Option(
        None, "--deploy-config",
        help="Pipeline config (YAML/JSON) to enforce; without it the first registrant's is adopted."),
) -> None:
    """Run a standalone omni master (the control plane) until SIGINT/SIGTERM/SIGHUP."""
    from omni.master.configdiff import hash_config
    from omni.master.server import MasterServer

    if not 0 <= port <= 65535:   # grpc would take it modulo 65536 and listen elsewhere
        typer.echo(f"omni master: --port must be a TCP port, 0-65535 (0: any free one), got {port}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    if not math.isfinite(lease_ttl):   # typer's min passes inf and nan: leases that never expire
        typer.echo(f"omni master: --lease-ttl must be finite seconds (>= 0.1), got {lease_ttl}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        refuse_open_master(host, omni_token, "--host")
        if deploy_config == "":   # read as unset, it would adopt the first registrant's config
            raise ConfigError("--deploy-config is empty; give a deploy YAML's path, or leave it unset")
        config = _load_config(deploy_config) if deploy_config else None
        tls = tls_from_options(tls_cert, tls_key, tls_ca)
        if tls is not None:   # checked here, naming the flag: gRPC's own refusal reads "cannot bind"
            if not (tls_cert and tls_key):
                raise ConfigError("--tls-cert and --tls-key: a TLS master needs both "
                                  "(--tls-ca then requires client certificates, mTLS)")
            tls.check()
        server = MasterServer(config, hash_config(config) if config else None, host=host, port=port,
                              token=omni_token, tls=tls,
                              lease_ttl_s=lease_ttl, state_dir=state_dir)
        # Handlers only note the request (no locks); the main thread does the stopping.
        stop = StopRequest().install()
        server.start()
    except OmniError as e:
        typer.echo(f"omni master: {e}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    print(f"omni master listening on {server.address}", flush=True)
    stop.wait()
    logger.info("stopping the omni master")
    server.stop(grace=1.0)


def _load_config(path: str) -> dict:
    """The resolved pipeline of a deploy YAML, as `omni serve` would resolve it."""
    from omni import config as cfg
    from omni.errors import ConfigError

    raw = cfg._read_yaml(Path(path))
    if not raw.get("model"):
        raise ConfigError(f"--deploy-config {path}: needs a `model` key for a standalone master")
    return cfg.load(str(raw["model"]), path, engines=False).to_dict()


def status(
    master: str | None = typer.Option(
        None, "--master", "-m",
        help=_MASTER_HELP + f" Default: the `omni serve` running on this host, else 127.0.0.1:{DEFAULT_PORT}."),
    json_: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
    watch: bool = typer.Option(False, "--watch", help="Refresh until Ctrl-C: at once when a replica comes, goes or "
                               "changes state, sleep or drain; at most once a second for queue and request counts."),
    omni_token: str | None = typer.Option(None, "--omni-token", envvar="OMNI_TOKEN", help=_TOKEN_HELP),
    tls_cert: str | None = typer.Option(None, "--tls-cert", help="PEM client certificate (mTLS)."),
    tls_key: str | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    tls_ca: str | None = typer.Option(None, "--tls-ca", help="PEM CA to verify the master (enables TLS)."),
) -> None:
    """Show the pipeline's replicas. Exit 0 when every stage has a READY, awake replica, 1 if not, 2 if the
    master cannot be reached, 130 on Ctrl-C before a view was shown (--watch: after one, as that view)."""
    from omni.master.client import MasterClient

    tls = client_tls("status", tls_cert, tls_key, tls_ca)
    if master is None:
        master, tls = _local_master(tls=tls)
    client = None
    try:
        with ctrl_c() as stop:
            client = MasterClient(master, token=omni_token, tls=tls, timeout_s=5.0)
            if watch:
                st = _watch(client, json_, stop)
            else:
                st = in_thread(client.get_status, stop)
                _show(st, json_, clear=False)
    except Interrupted:
        typer.echo("omni status: interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OmniError as e:
        typer.echo(f"omni status: {_one_line(str(e))}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    finally:
        if client is not None:
            client.close()
    problems = st.problems()
    for line in problems:
        typer.echo(f"omni status: {line}", err=True)
    raise typer.Exit(EXIT_NOT_READY if problems else EXIT_OK)


def client_tls(verb: str, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """The --tls-* files a client command was given, checked (one line naming the flag, exit 2): unchecked, a
    file that is no PEM got gRPC's C-core error lines and a message blaming the connection."""
    try:
        tls = tls_from_options(cert, key, ca)
        if tls is not None:
            tls.check()
    except ConfigError as e:
        typer.echo(f"omni {verb}: {e}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    return tls


def _local_master(verb: str = "status", tls: TlsFiles | None = None,
                  only_one: bool = False) -> tuple[str, TlsFiles | None]:
    """The master of the `omni serve` started on this host (its run file), says which it picked, and
    how to connect to it: the given --tls-* files, else those that serve's own processes use.
    `only_one` (a command that changes state): of several, none is picked (exit 2, listing them), as
    draining or sleeping the newest one by default could stop a deployment the user did not mean."""
    from omni import runfile

    runs = runfile.live_runs()
    if not runs:
        return f"127.0.0.1:{DEFAULT_PORT}", tls
    if only_one and len(runs) > 1:
        lines = [f"omni {verb}: {len(runs)} `omni serve` deployments run on this host; say which with --master:"]
        for r in runs:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"])) if r.get("started") else "?"
            lines.append(f"  --master {r['master']}  (`omni serve {r.get('model')}`, pid {r['pid']}, started {started})")
        typer.echo("\n".join(lines), err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    run = runs[0]
    more = f" (the newest of {len(runs)} on this host; --master picks another)" if len(runs) > 1 else ""
    if tls is None and isinstance(run.get("tls"), dict):
        tls = TlsFiles(*(run["tls"].get(k) for k in ("cert", "key", "ca")))
    typer.echo(f"omni {verb}: found `omni serve {run.get('model')}` (pid {run['pid']}), master "
               f"{run['master']}{' (TLS)' if tls is not None else ''}{more}", err=True)
    return str(run["master"]), tls


class Interrupted(Exception):
    """Ctrl-C came while a call to the master ran."""


@contextlib.contextmanager
def ctrl_c() -> Iterator[StopRequest]:
    """A StopRequest that SIGINT sets (the handler only notes it) while the block runs; the
    previous handler is put back after. Off the main thread no handler can be set: never set."""
    stop = StopRequest()
    old = signal.signal(signal.SIGINT, stop.set) if threading.current_thread() is threading.main_thread() else None
    try:
        yield stop
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
        stop.close()


def in_thread(fn: Callable[[], T], stop: StopRequest) -> T:
    """fn() on a daemon thread while this thread waits (in slices) for it or for `stop`: a Ctrl-C
    raised as KeyboardInterrupt inside grpc's code can leave the channel so that closing it hangs
    (grpc issue 19973), so no grpc call runs on the thread the signal interrupts. fn's result or
    its exception; Interrupted when stopped first (fn may still run: close what it waits on)."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()
    threading.Thread(target=run, name="omni-master-call", daemon=True).start()
    while not done.wait(0.1):
        if stop.is_set():
            raise Interrupted()
    if "error" in box:
        raise box["error"]
    return box["value"]


LOAD_REDRAW_S = 1.0   # --watch: load figures alone redraw at most this often


def _shape(st: Status) -> tuple:
    """What the view shows apart from load figures and ages: a change of it redraws at once."""
    return (st.has_config, st.config_hash, [(s.stage_id, s.ready_replicas, s.live_replicas) for s in st.stages],
            sorted((r.replica_id, r.role, r.stage_id, r.host, r.pid, r.state, r.is_sleeping, r.draining)
                   for r in st.replicas))


def _load(st: Status) -> list:
    return sorted((r.replica_id, r.queue_len, r.in_flight, r.requests_total) for r in st.replicas)


def _watch(client, json_: bool, stop: StopRequest) -> Status:
    """Print the view at the watch's SNAPSHOT (a printed line means the watch is registered: no
    change after it is missed), at once at every change of its shape (replicas, states, sleep, drain),
    and at most every LOAD_REDRAW_S for a change of load figures alone: the master sends an event per
    replica each load interval (a stage's CPU seconds always move), which redrew an idle deployment
    3-4 times a second. Until Ctrl-C or the watch ends. -> the last view."""
    watch = client.watch()
    last: dict[str, Status] = {}
    clear = not json_ and sys.stdout.isatty()
    events: queue.SimpleQueue = queue.SimpleQueue()   # True: an event; None: the watch ended; or its error

    def pump() -> None:
        try:
            for _ in watch:
                events.put(True)
            events.put(None)
        except BaseException as e:
            events.put(e)

    def follow() -> None:
        shown_at, held = 0.0, False   # held: a load change not yet shown
        while True:
            try:
                items = [events.get(timeout=max(0.0, shown_at + LOAD_REDRAW_S - time.monotonic()) if held else None)]
            except queue.Empty:
                items = []            # the held load change is due
            while not events.empty():
                items.append(events.get())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            if None in items:
                return
            st = client.get_status()
            if stop.is_set():
                return
            if "st" in last and _shape(st) == _shape(last["st"]):
                held = _load(st) != _load(last["st"])
                if not held or time.monotonic() - shown_at < LOAD_REDRAW_S:
                    continue
            _show(st, json_, clear=clear and "st" in last)
            last["st"], shown_at, held = st, time.monotonic(), False
    threading.Thread(target=pump, name="omni-status-watch", daemon=True).start()
    try:
        in_thread(follow, stop)
    except Interrupted:
        pass
    finally:
        watch.cancel()
    if "st" not in last:       # stopped before the first view
        raise Interrupted()
    return last["st"]


def _show(st: Status, json_: bool, clear: bool) -> None:
    if json_:
        from omni.master.configdiff import shown

        doc = msgspec.to_builtins(st)
        doc["pipeline_config"] = shown(doc["pipeline_config"])   # the master masks it too (an older one did not)
        doc["problems"] = st.problems()
        print(json.dumps(doc, sort_keys=True), flush=True)
        return
    if clear:
        print("\033[2J\033[H", end="")
    print(render_table(st), flush=True)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def render_table(st: Status) -> str:
    """The human view of a Status: a stages table and a frontends table."""
    if not st.has_config:
        return "no pipeline config yet (nothing has registered)"
    lines = [f"pipeline: {len(st.stages)} stage(s), config {st.config_hash[:12]}, lease ttl {st.lease_ttl_s:g} s", ""]
    stage_rows = []
    for stage in st.stages:
        reps = [r for r in st.replicas if r.role == "STAGE" and r.stage_id == stage.stage_id]
        if not reps:
            stage_rows.append([str(stage.stage_id), "-", "-", "-", "NO REPLICA", "-", "-", "-", "-"])
        for r in reps:
            stage_rows.append([str(r.stage_id), r.replica_id, r.host, str(r.pid), r.state, str(r.queue_len),
                               str(r.in_flight), f"{r.heartbeat_age_s:.1f}s", "yes" if r.is_sleeping else "no"])
    lines += _table(["STAGE", "REPLICA", "HOST", "PID", "STATE", "QUEUE", "IN-FLIGHT", "HEARTBEAT", "SLEEPING"],
                    stage_rows)
    fronts = [r for r in st.replicas if r.role == "FRONTEND"]
    lines.append("")
    if fronts:
        lines += _table(["FRONTEND", "HOST", "PID", "STATE", "REQUESTS", "IN-FLIGHT"],
                        [[r.replica_id, r.host, str(r.pid), r.state, str(r.requests_total), str(r.in_flight)]
                         for r in fronts])
    else:
        lines.append("no frontends registered")
    return "\n".join(lines)
