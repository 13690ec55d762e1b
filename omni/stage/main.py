"""Entry of a stage replica process: `omni serve MODEL --stage-id K --headless ...`.

build engine -> bind channel -> register -> keep-alive -> loop; SIGTERM/SIGINT/SIGHUP
stop the loop (finish or abort in flight within a grace period), deregister,
free shared memory, exit. A failure to start prints its cause and exits 1.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni.config import DeployConfig
from omni.errors import ConfigError, OmniError
from omni.netaddr import is_ipv6
from omni.signals import StopRequest

if TYPE_CHECKING:
    from omni.master.auth import TlsFiles

logger = logging.getLogger(__name__)

EXIT_WITHIN_S = 3.0   # after run_stage returns


@dataclass(frozen=True)
class StageOptions:
    master_address: str
    token: str = ""
    replica_address: str | None = None     # advertised host of this replica's endpoints
    replica_hint: int = -1
    grace_s: float = 5.0
    register_wait_s: float = 120.0
    tls: TlsFiles | None = None            # how to connect to the master (None: plaintext)


def progress(msg: str) -> None:
    try:
        print(f"omni: {msg}", file=sys.stderr, flush=True)
    except OSError:
        pass   # stderr is a pipe to a launcher that is gone: the stop goes on without words


def default_advertise_host(master_address: str) -> str:
    """The local address that routes to the master (what peers can reach us on): for an IPv6 master its IPv6
    route, for a name its IPv4 route, else its IPv6 one (an IPv6-only network); loopback where none is found."""
    host = master_address.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost") or is_wildcard(host):
        return "127.0.0.1"   # a master on every interface: its stages here dial it on loopback
    v6 = is_ipv6(host)
    for family in (socket.AF_INET6,) if v6 else (socket.AF_INET, socket.AF_INET6):
        found = _route_source(host, family)
        if found:
            return found
    return "::1" if v6 else "127.0.0.1"


def _route_source(host: str, family: socket.AddressFamily) -> str | None:
    """The source address of this host's route to `host` in `family` (a UDP connect sends nothing); None where
    there is none (no route, or a name without an address of that family)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def is_wildcard(host: str) -> bool:
    """0.0.0.0, ::, their other spellings ("0", "[::]", "0:0::0", "::ffff:0.0.0.0") and an empty host: bound,
    every interface."""
    h = host.strip().strip("[]")
    if not h or h == "*":   # ZMQ's tcp://*: every interface
        return True
    try:
        ip = ipaddress.ip_address(h)
        mapped = getattr(ip, "ipv4_mapped", None)   # ::ffff:0.0.0.0 binds every IPv4 interface
        return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)
    except ValueError:
        pass
    try:
        return socket.inet_aton(h) == bytes(4)      # what bind() reads too: "0", "0.0"
    except OSError:
        return False


def check_replica_address(address: str | None, token: str | None) -> None:
    """ConfigError for a wildcard, or an address beyond loopback without a token: a stage binds its listeners
    on the address it advertises, and there they would take anyone (every interface, for a wildcard)."""
    from omni.master.auth import refuse_open_stage

    if address is None:
        return
    if is_wildcard(address):
        raise ConfigError(f"--omni-replica-address {address!r} is a wildcard: a stage binds its listeners on the "
                          "address it advertises, so name this host's address (peers dial it), or leave the "
                          "flag out for the local address of the route to the master")
    refuse_open_stage(address, token, f"--omni-replica-address {address}")


def check_advertise(replica_address: str | None, master_address: str, token: str | None) -> str:
    """The address a stage advertises (and binds): the given --omni-replica-address, else the local address of
    the route to the master; ConfigError where its listeners would be open (check_replica_address)."""
    from omni.master.auth import refuse_open_stage

    check_replica_address(replica_address, token)
    if replica_address is not None:
        return replica_host(replica_address, master_address)
    picked = default_advertise_host(master_address)
    refuse_open_stage(picked, token, f"{picked} (the local address of the route to the master; "
                      "no --omni-replica-address given)")
    return picked


def replica_host(replica_address: str | None, master_address: str) -> str:
    """The host a stage registers under and binds: --omni-replica-address (an IPv6 one without brackets, as
    sockets take it), else the local address of the route to the master."""
    return replica_address.strip("[]") if replica_address else default_advertise_host(master_address)


def advertised_host(bind_host: str, master_address: str) -> str:
    """What peers should dial for a listener bound on `bind_host`: itself, unless it is
    a wildcard (0.0.0.0, ::), then the local address that routes to the master."""
    if is_wildcard(bind_host):
        return default_advertise_host(master_address)
    return bind_host.strip("[]")   # `--host [::1]` is the host ::1, as the stages register theirs


def select_devices(devices: str) -> None:
    """A stage's `devices` ("1", "0,1") become CUDA_VISIBLE_DEVICES before any engine touches CUDA,
    as indices into an outer CUDA_VISIBLE_DEVICES when one is set. "cpu" leaves it alone."""
    devices = (devices or "").strip()
    if not devices or devices == "cpu":
        return
    wanted = [d.strip() for d in devices.split(",") if d.strip()]
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None and outer.strip():
        visible = [d.strip() for d in outer.split(",")]
        try:
            wanted = [visible[int(d)] for d in wanted]
        except (ValueError, IndexError):
            raise OmniError(f"devices {devices!r}: not indices into CUDA_VISIBLE_DEVICES={outer!r}") from None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(wanted)


def run_stage(config: DeployConfig, stage_id: int, opts: StageOptions,
              engine_flags: dict | None = None) -> int:
    """`config` is the hashed pipeline; `engine_flags` tune this replica's engine only.
    Every process the stage started (vLLM's EngineCore and Worker) is gone when it returns."""
    # The stage's `env` first, before anything here imports torch or vLLM (they read some variables as they
    # load) and before `devices` become CUDA_VISIBLE_DEVICES; the processes the engine starts inherit it.
    os.environ.update(config.stage(stage_id).env)
    from omni import fsutil, proctree

    # Grandchildren orphaned by a dying child (vLLM's Worker) come back to us, not PID 1.
    proctree.become_subreaper()
    code = 1
    try:
        code = _run_stage(config, stage_id, opts, engine_flags)
        return code
    finally:
        left = proctree.kill_descendants(grace_s=1.0, exclude=_own_helpers())
        if left:
            progress(f"stage {stage_id}: killed processes the engine left behind: {proctree.describe(left)}")
        fsutil.remove_registered()   # what an engine that failed to load (or never shut down) made
        # Everything is released; what is left is the interpreter's exit, which joins the engine
        # library's threads (one waiting on a gone EngineCore held a stage past the launcher's 10 s).
        timer = threading.Timer(EXIT_WITHIN_S, os._exit, args=(code,))
        timer.daemon = True
        timer.start()


def _own_helpers() -> tuple[int, ...]:
    """multiprocessing's resource tracker cleans up after us once we exit: spare it."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return (pid,) if pid else ()


def _stop_while_loading(stop: StopRequest, label: str) -> tuple[threading.Event, threading.Lock]:
    """A stop during the engine load ends the process at once: nothing is registered or served
    yet, and a load (vLLM: tens of seconds) does not look at the stop flag. The caller sets the
    event, under the lock, once the engine is loaded."""
    from omni import fsutil, proctree

    loaded, lock = threading.Event(), threading.Lock()

    def watch() -> None:
        while not loaded.is_set():
            if stop.wait(0.2):
                with lock:
                    if loaded.is_set():
                        return
                    progress(f"{label}: stopped while loading the engine")
                    proctree.kill_descendants(exclude=_own_helpers())
                    fsutil.remove_registered()   # vLLM's ipc folder: the engine's shutdown never runs
                    os._exit(0)
    threading.Thread(target=watch, name="omni-stop-while-loading", daemon=True).start()
    return loaded, lock


def master_refusal(config: DeployConfig, stage_id: int, opts: StageOptions) -> str | None:
    """Why the master will refuse this replica, asked in one quick call before the engine load (a load can
    take minutes, and the registration after it is where a wrong token or another config showed): a refused
    token, a connection it closes in the handshake twice (plaintext to a TLS master, no client certificate for
    an mTLS one), or a pipeline config other than the one the master holds. None when it would take it, has no
    config yet, or does not answer yet (the registration waits for it, `register_wait_s`)."""
    from omni.master.client import MasterClient
    from omni.master.configdiff import diff_pipeline, shown
    from omni.master.errors import ClosedByMaster, Unauthenticated

    def ask():
        with MasterClient(opts.master_address, token=opts.token or None, tls=opts.tls, timeout_s=3.0) as client:
            return client.get_status()

    try:
        try:
            st = ask()
        except ClosedByMaster:   # a master still starting may close one connection; a TLS mismatch closes all
            time.sleep(1.0)
            st = ask()   # on a new channel: none of the first one's reconnect backoff
    except (Unauthenticated, ClosedByMaster) as e:
        return str(e)
    except OmniError as e:
        logger.info("master not answering yet (the registration waits for it): %s", e)
        return None
    mine = config.config_hash()
    if not st.has_config or st.config_hash == mine:
        return None
    # The master shows its config with env values and secrets masked: compare ours masked alike.
    lines = diff_pipeline(st.pipeline_config, shown(config.to_dict()), stage_id)
    return (f"stage {stage_id} config differs from the master's at {opts.master_address} (config_hash master="
            f"{st.config_hash[:12]} replica={mine[:12]}): "
            + ("; ".join(lines) if lines else "in a value not shown (a stage's env or engine_args.hf_token)"))


def _run_stage(config: DeployConfig, stage_id: int, opts: StageOptions, engine_flags: dict | None) -> int:
    from omni import latency_trace
    from omni.heap import freeze_after_startup
    from omni.config import apply_engine_flags, current_platform

    stage = apply_engine_flags(config, stage_id, engine_flags or {}).stage(stage_id)
    from omni.engines.factory import build_engine
    from omni.master.client import MasterClient
    from omni.orchestrator.limits import replica_limits
    from omni.stage.gpu_lock import one_load_per_gpu
    from omni.stage.gpus import check_gpus
    from omni.stage.local_link import local_enabled
    from omni.stage.worker import StageWorker
    from omni.transport.factory import MultiConsumer, make_producer

    # The handler only notes the request (no locks); the worker's loop polls it and stops.
    stop = StopRequest().install()

    label = stage.label
    try:
        local_channel = local_enabled()
    except OmniError as e:
        progress(f"{label}: {e}")
        return 1
    try:
        advertise = check_advertise(opts.replica_address, opts.master_address, opts.token)   # children's too
    except ConfigError as e:
        progress(f"{label}: {e}")
        return 1
    refused = master_refusal(config, stage_id, opts)
    if refused:
        progress(f"{label}: {refused}; the engine is not loaded")
        return 1
    # Listeners bind the advertised address only (loopback on one host), never a wildcard.
    bind_host = advertise
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        select_devices(stage.devices)
        check_gpus(stage.stage_id, label, stage.devices, outer, current_platform(), say=progress)
    except OmniError as e:
        progress(f"{label}: {e}; the engine is not loaded")
        return 1
    loaded, load_lock = _stop_while_loading(stop, label)
    try:
        # stages sharing a GPU load one at a time: vLLM sizes its KV cache from the GPU's free memory
        with one_load_per_gpu(stage.devices, label, say=progress):
            progress(f"{label}: loading engine {stage.engine} ...")
            t0 = time.monotonic()
            engine = build_engine(config, stage)
    except OmniError as e:
        progress(f"{label}: cannot start engine {stage.engine}: {e}")
        return 1
    except Exception as e:  # the cause, not "see above"
        logger.debug("engine load failed", exc_info=True)
        progress(f"{label}: engine {stage.engine} failed to load: {type(e).__name__}: {e}")
        return 1
    finally:
        with load_lock:
            loaded.set()
    progress(f"{label}: engine loaded in {time.monotonic() - t0:.1f} s")

    default_transport = "shm"

    arenas = [c.arena_bytes for c in stage.connectors.values() if c.arena_bytes]

    def producer_opts(kind: str) -> dict:
        if kind in ("shm", "cuda_ipc"):
            return {"token": opts.token or None, **({"arena_bytes": max(arenas)} if arenas else {})}
        return {"token": opts.token or None, "advertise_host": advertise}
    worker = StageWorker(
        stage, engine, host=bind_host, advertise_host=advertise, token=opts.token,
        default_transport=default_transport,
        make_producer=lambda kind: make_producer(kind, host=bind_host, **producer_opts(kind)),
        consumer=MultiConsumer(token=opts.token),
        stall_timeout_s=config.pipeline.stall_timeout_s,
        loop_stall_s=config.pipeline.loop_stall_s,
        published_ttl_s=config.pipeline.request_timeout_s,
        stop_request=stop,
        local_channel=local_channel,
    )
    if stop.is_set():
        worker.close()
        return 0

    client = MasterClient(opts.master_address, token=opts.token or None, tls=opts.tls)
    progress(f"{label}: registering with the omni master at {opts.master_address} ...")
    try:
        reg = client.register(
            "STAGE", stage.stage_id,
            config_hash=config.config_hash(),
            pipeline_config=config.to_dict(),
            endpoints={"channel": worker.endpoint,
                       **({"local": worker.local_endpoint} if worker.local_endpoint else {})},
            replica_hint=opts.replica_hint,
            host=advertise,
            pid=os.getpid(),
            capabilities={"can_sleep": "true" if engine.can_sleep() else "false",
                          "engine": stage.engine, **replica_limits(engine)},
            wait_s=opts.register_wait_s,
            stop=stop,
        )
    except OmniError as e:
        progress(f"{label}: registration refused: {e}")
        worker.close()
        return 1
    if reg is None:
        progress(f"{label}: stopped while waiting for the omni master at {opts.master_address}")
        worker.close()
        client.close()
        return 0
    worker.replica_id = reg.replica_id

    def on_registration(r):
        worker.replica_id = r.replica_id
        progress(f"{label}: re-registered as replica {r.replica_id}")

    def on_command(cmd):
        return worker.command(cmd.kind, cmd.args)

    client.start_keepalive(worker.load_snapshot.read, on_command, interval_s=min(1.0, reg.lease_ttl_s / 4),
                           on_registration=on_registration, withhold=worker.loop_watch.wedged)
    progress(f"{label}: registered as replica {reg.replica_id}, serving on {worker.endpoint}"
             + (f" and {worker.local_endpoint}" if worker.local_endpoint else "") + "; ready")
    freeze_after_startup()
    latency_trace.enable(f"stage{stage.stage_id}")
    try:
        worker.run(grace_s=opts.grace_s)
    finally:
        try:
            client.deregister()
        except OmniError as e:
            logger.info("deregister failed: %s", e)
        client.close()
    if worker.fatal:
        progress(f"{label}: replica {reg.replica_id} failed: {worker.fatal}")
        return 1
    progress(f"{label}: replica {reg.replica_id} stopped")
    return 0


def main_from_args(config_json: str, stage_id: int, opts: StageOptions, log_level: str = "INFO") -> int:
    """For child processes the launcher spawns (config already resolved)."""
    from omni.config import loads_json

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_stage(loads_json(config_json), stage_id, opts)
