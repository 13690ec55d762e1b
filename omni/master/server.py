"""The gRPC master: grpc.aio on its own event loop in its own thread, so any process can embed it.

Every registry access happens on that loop (handlers and the lease sweeper are coroutines on
it), so the pure Registry needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from typing import Callable

import grpc

from omni._proto import master_pb2 as pb
from omni._proto import master_pb2_grpc as pb_grpc
from omni.errors import ConfigError
from omni.master import limits, wire
from omni.master.auth import TlsFiles, TokenInterceptor
from omni.master.errors import KV_FULL
from omni.master.kv import KvError, KvFull, KvStore
from omni.master.registry import (
    BadRegistration, ConfigMismatch, Event, LeaseUnknown, Load, RegisterInput, Registry, RegistryFull, Role,
)
from omni.master.targets import WaitHolds, command_targets, would_stop
from omni.master.types import sleep_stops
from omni.netaddr import host_port

logger = logging.getLogger(__name__)

WATCH_BACKLOG = 10_000
MAX_COMMAND_TIMEOUT_S = 600.0


def server_options() -> list[tuple[str, int]]:
    """Allow the clients' keep-alive pings on idle connections (limits.KEEPALIVE_MS, half that for slack); bound
    what one connection holds and for how long (limits: what peers without the token can make the master keep)."""
    return [("grpc.so_reuseport", 0), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", limits.KEEPALIVE_MS // 2),
            ("grpc.max_concurrent_streams", limits.MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_receive_message_length", limits.MAX_REQUEST_BYTES),
            ("grpc.max_connection_idle_ms", limits.MAX_IDLE_MS), ("grpc.max_connection_age_ms", limits.MAX_AGE_MS),
            ("grpc.server_handshake_timeout_ms", limits.HANDSHAKE_TIMEOUT_MS)]


def sweep_tick(lease_ttl_s: float) -> float:
    return max(0.05, min(0.25, lease_ttl_s / 10))


class _Conn:
    """One keep-alive stream: commands to send down, acks awaited."""

    def __init__(self, lease_id: str):
        self.lease_id = lease_id
        self.outbox: asyncio.Queue[pb.Command] = asyncio.Queue()
        self.pending: dict[str, asyncio.Future] = {}

    def fail_pending(self, message: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result((False, message, "disconnected"))
        self.pending.clear()


class _Watcher:
    def __init__(self):
        self.items: collections.deque[pb.TopologyEvent] = collections.deque()
        self.wake = asyncio.Event()
        self.overflowed = False

    def push(self, event: pb.TopologyEvent) -> None:
        if len(self.items) >= WATCH_BACKLOG:
            self.overflowed = True
        else:
            self.items.append(event)
        self.wake.set()


class MasterServicer(pb_grpc.MasterServicer):
    def __init__(self, registry: Registry, kv: KvStore):
        self.reg = registry
        self.kv = kv
        self._conns: dict[str, _Conn] = {}
        self._watchers: set[_Watcher] = set()
        self._seq = 0
        self._streams: set[asyncio.Task] = set()   # KeepAlive/WatchTopology handlers, ended at close
        self._closing = False
        # Replicas a DRAIN or SLEEP is being sent to (acks awaited): they count as stopped for the
        # keep_serving check of a concurrent one, so two drains cannot stop a stage's last two replicas.
        self._stopping: collections.Counter[str] = collections.Counter()
        self._holds = WaitHolds()   # sleeps with mode=wait under way: a WAKE_UP meanwhile is refused

    async def close(self, timeout: float = 1.0) -> None:
        """End the open streams as handlers that return (OK to the peer): a stream the grpc
        server cancels at stop prints a traceback per stream."""
        self._closing = True
        for task in self._streams:
            task.cancel()
        if self._streams:
            await asyncio.wait(list(self._streams), timeout=timeout)

    def _stream_started(self) -> asyncio.Task:
        task = asyncio.current_task()
        self._streams.add(task)
        return task

    # -- topology events --------------------------------------------------------------------
    def publish(self, events: list[Event]) -> None:
        for ev in events:
            self._seq += 1
            info = wire.replica_to_pb(ev.replica, max(0.0, ev.at - ev.replica.last_seen))
            msg = pb.TopologyEvent(kind=pb.TopologyEvent.Kind.Value(ev.kind), replicas=[info], seq=self._seq)
            for w in self._watchers:
                w.push(msg)

    def _infos(self) -> list[pb.ReplicaInfo]:
        return [wire.replica_to_pb(r, self.reg.heartbeat_age(r)) for r in self.reg.replicas()]

    # -- RPCs -------------------------------------------------------------------------------
    async def Register(self, request: pb.RegisterRequest, context):
        cfg, problem = limits.parse_register(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        req = RegisterInput(
            role=Role(pb.Role.Name(request.role)), stage_id=request.stage_id, host=request.host, pid=request.pid,
            config_hash=request.config_hash, pipeline_config=cfg, replica_hint=request.replica_hint,
            endpoints=dict(request.endpoints), version=request.version, capabilities=dict(request.capabilities),
            instance_id=request.instance_id)
        try:
            rep, events = self.reg.register(req)
        except ConfigMismatch as e:
            logger.warning("refused %s pid %d on %s: %s", req.role.value, req.pid, req.host, e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BadRegistration as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryFull as e:
            logger.warning("refused %s pid %d on %s: %s", req.role.value, req.pid, req.host, e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        logger.info("registered %s (pid %d on %s) endpoints=%s", rep.replica_id, rep.pid, rep.host, rep.endpoints)
        self.publish(events)
        from omni.master.configdiff import shown, shown_stage

        stage_cfg = self.reg.stage_config(rep.stage_id) if rep.role is Role.STAGE else {}
        full = self.reg.config
        if cfg != full:   # the config hash alone is in GetStatus: only a registrant that sent the config gets its secrets
            full, stage_cfg = shown(full), shown_stage(stage_cfg)
        return pb.RegisterResponse(
            replica_id=rep.replica_id, replica_index=rep.index, lease_id=rep.lease_id,
            lease_ttl_s=self.reg.lease_ttl_s, stage_config_json=json.dumps(stage_cfg),
            pipeline_config_json=json.dumps(full))

    async def KeepAlive(self, request_iterator, context):
        conn: _Conn | None = None
        writer: asyncio.Task | None = None
        me = self._stream_started()
        try:
            async for hb in request_iterator:
                if conn is None:
                    try:
                        self.reg.live(hb.lease_id)
                    except LeaseUnknown as e:
                        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
                    conn = _Conn(hb.lease_id)
                    old = self._conns.get(conn.lease_id)
                    if old is not None:
                        old.fail_pending("superseded by a new keep-alive stream")
                    self._conns[conn.lease_id] = conn
                    writer = asyncio.create_task(self._pump(conn, context))
                elif hb.lease_id != conn.lease_id:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id changed within a keep-alive stream")
                await self._heartbeat(conn, hb, context)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._streams.discard(me)
            if writer is not None:
                writer.cancel()
            if conn is not None and self._conns.get(conn.lease_id) is conn:
                del self._conns[conn.lease_id]
                conn.fail_pending("keep-alive stream broke before the ack")
                self.publish(self.reg.stream_broken(conn.lease_id))

    async def _heartbeat(self, conn: _Conn, hb: pb.Heartbeat, context) -> None:
        problem = limits.extra_problem(hb.extra)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        load = None if hb.no_load else Load(
            queue_len=hb.queue_len, in_flight=hb.in_flight, requests_total=hb.requests_total,
            cpu_seconds=hb.cpu_seconds, is_sleeping=hb.is_sleeping, draining=hb.draining, extra=dict(hb.extra))
        try:
            events = self.reg.heartbeat(conn.lease_id, load)
        except LeaseUnknown as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        self.publish(events)
        for ack in hb.acks:
            fut = conn.pending.pop(ack.command_id, None)
            if fut is not None and not fut.done():
                fut.set_result((ack.ok, ack.message, "acked"))

    @staticmethod
    async def _pump(conn: _Conn, context) -> None:
        try:
            while True:
                await context.write(await conn.outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream is going away; the reader side cleans up
            logger.debug("keep-alive write failed for lease %s: %s", conn.lease_id[:12], e)

    async def Deregister(self, request: pb.DeregisterRequest, context):
        conn = self._conns.pop(request.lease_id, None)
        if conn is not None:
            conn.fail_pending("replica deregistered")
        rep = self.reg.lookup(request.lease_id)
        removed, events = self.reg.deregister(request.lease_id)
        if rep is not None:
            logger.info("deregistered %s (pid %d on %s)", rep.replica_id, rep.pid, rep.host)
        self.publish(events)
        return pb.DeregisterResponse(removed=removed)

    async def GetStatus(self, request, context):
        from omni.master.configdiff import shown   # env values and secret engine args as "***"

        cfg = self.reg.config
        return pb.StatusResponse(
            replicas=self._infos(),
            stages=[pb.StageStatus(stage_id=s, ready_replicas=r, live_replicas=n) for s, r, n in self.reg.stage_counts()],
            config_hash=self.reg.config_hash, has_config=cfg is not None, lease_ttl_s=self.reg.lease_ttl_s,
            pipeline_config_json=json.dumps(shown(cfg)) if cfg is not None else "")

    async def WatchTopology(self, request, context):
        watcher = _Watcher()
        snapshot = pb.TopologyEvent(kind=pb.TopologyEvent.SNAPSHOT, replicas=self._infos(), seq=self._seq)
        self._watchers.add(watcher)  # same loop step as the snapshot: no event is lost or doubled
        me = self._stream_started()
        try:
            yield snapshot
            while True:
                while not watcher.items and not watcher.overflowed:
                    watcher.wake.clear()
                    await watcher.wake.wait()
                if watcher.overflowed:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"watcher fell {WATCH_BACKLOG} events behind; watch again")
                yield watcher.items.popleft()
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._streams.discard(me)
            self._watchers.discard(watcher)

    async def SendCommand(self, request: pb.SendCommandRequest, context):
        if request.kind == pb.COMMAND_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "command kind is required")
        if request.kind not in pb.CommandKind.values():   # never sent down: a stage could not name it either
            known = ", ".join(n for n in pb.CommandKind.keys() if n != "COMMAND_UNSPECIFIED")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown command kind {request.kind} (known: {known})")
        problem = limits.command_timeout(request.timeout_s)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.args_json:
            try:
                json.loads(request.args_json)
            except (ValueError, RecursionError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"args_json is not valid JSON: {e}")
        targets, problem = command_targets(self.reg, request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        problem = self._holds.refusal(request)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        self._holds.note(request)
        stopping = [r.replica_id for r in targets if request.kind == pb.DRAIN
                    or (request.kind == pb.SLEEP and sleep_stops(r.capabilities))]
        if stopping and request.keep_serving:
            stopped = self.reg.last_serving(set(stopping) | set(self._stopping))
            if stopped:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    would_stop(request.kind, stopped, self.reg, set(self._stopping)))
        self._stopping.update(stopping)      # no await since the check: no other command came between
        try:
            return await self._send(request, targets)
        finally:
            self._stopping -= collections.Counter(stopping)

    async def _send(self, request: pb.SendCommandRequest, targets: list) -> pb.SendCommandResponse:
        timeout = min(request.timeout_s or 10.0, MAX_COMMAND_TIMEOUT_S)
        command_id = uuid.uuid4().hex
        cmd = pb.Command(command_id=command_id, kind=request.kind, args_json=request.args_json)
        waits: dict[str, asyncio.Future] = {}
        loop = asyncio.get_running_loop()
        for rep in targets:
            conn = self._conns.get(rep.lease_id)
            fut = loop.create_future()
            if conn is None:
                fut.set_result((False, f"no keep-alive stream (the replica is {rep.state.value})", "disconnected"))
            else:
                conn.pending[command_id] = fut
                conn.outbox.put_nowait(cmd)
            waits[rep.replica_id] = fut
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout)
        results = []
        for rep in targets:
            fut = waits[rep.replica_id]
            if fut.done():
                ok, message, outcome = fut.result()
            else:
                ok, message, outcome = False, f"no ack within {timeout:g} s", "timeout"
                conn = self._conns.get(rep.lease_id)
                if conn is not None:
                    conn.pending.pop(command_id, None)
            if ok and request.kind == pb.DRAIN:
                self.publish(self.reg.drain(rep.replica_id))
            elif ok and request.kind == pb.UNDRAIN:
                self.publish(self.reg.undrain(rep.replica_id))
            results.append(pb.CommandResult(replica_id=rep.replica_id, stage_id=rep.stage_id, ok=ok,
                                            message=message, outcome=outcome))
        logger.info("command %s %s: %d/%d ok", pb.CommandKind.Name(request.kind), command_id[:8],
                    sum(r.ok for r in results), len(results))
        return pb.SendCommandResponse(command_id=command_id, results=results)

    async def _kv(self, context, fn: Callable, *args):
        try:
            return fn(*args)
        except KvFull as e:   # marked: the client's only RESOURCE_EXHAUSTED that is the caller's (HTTP 400)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=(KV_FULL,))
        except KvError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def KvPut(self, request, context):
        written = await self._kv(context, self.kv.put, request.namespace, request.key, request.value,
                                 request.only_if_exists, request.only_if_absent)
        return pb.KvPutResponse(absent=not written)

    async def KvGet(self, request, context):
        value = await self._kv(context, self.kv.get, request.namespace, request.key)
        return pb.KvGetResponse(found=value is not None, value=value or b"")

    async def KvList(self, request, context):
        items, after = await self._kv(context, self.kv.list, request.namespace, request.prefix,
                                      request.limit, request.start_after)
        return pb.KvListResponse(entries=[pb.KvEntry(key=k, value=v) for k, v in items.items()],
                                 next_start_after=after)

    async def KvDelete(self, request, context):
        return pb.KvDeleteResponse(deleted=await self._kv(context, self.kv.delete, request.namespace, request.key))


def _finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left (the RPC tasks of streams still open at stop) and let it unwind, as
    asyncio.run does; a task destroyed pending makes grpc and asyncio print tracebacks."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


class MasterServer:
    """An embeddable master. `start()` binds (port 0: any free port) and returns the bound port."""

    def __init__(self, config: dict | None = None, config_hash: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, tls: TlsFiles | None = None, lease_ttl_s: float = 5.0,
                 state_dir: str | None = None, clock: Callable[[], float] = time.monotonic):
        try:
            self.registry = Registry(config, config_hash, lease_ttl_s=lease_ttl_s, clock=clock,
                                     stall_after_s=max(4 * sweep_tick(lease_ttl_s), lease_ttl_s / 2))
        except BadRegistration as e:
            raise ConfigError(f"master pipeline config: {e}") from None
        self._kv = KvStore(state_dir)
        self.host, self.port = host, port
        self._token, self._tls = token, tls
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._grace = 1.0
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._servicer: MasterServicer | None = None

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    def start(self, timeout_s: float = 30.0) -> int:
        if self._thread is not None:
            raise RuntimeError("master already started")
        self._thread = threading.Thread(target=self._run, name="omni-master", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"omni master did not start within {timeout_s} s")
        if self._start_error is not None:
            self._thread.join(5)
            raise self._start_error
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._grace = grace
        try:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        except RuntimeError:
            pass  # the loop already ended
        self._thread.join(grace + 10)
        self._thread = None
        self._kv.close()

    def process_exited(self, host: str, pid: int, role: Role, instance_id: str = "") -> list[str]:
        """For the launcher that hosts this master: a child it reaped (frontend or stage replica) is DEAD here now,
        not a lease TTL later (a restart would find its index held). Run on the loop, as every registry access
        -> ids marked."""
        servicer, loop = self._servicer, self._loop
        if servicer is None or loop is None or not loop.is_running():
            return []

        async def mark() -> list[str]:
            events = self.registry.exited(role, host, pid, instance_id)
            servicer.publish(events)
            return [e.replica.replica_id for e in events]

        try:
            return asyncio.run_coroutine_threadsafe(mark(), loop).result(timeout=5.0)
        except Exception as e:   # a stopping master (also one whose loop ended mid-mark): the lease expires it
            logger.info("could not mark pid %d on %s gone: %r", pid, host, e)
            return []

    def __enter__(self) -> "MasterServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start() or logged after it
            if not self._started.is_set():
                self._start_error = e
            else:
                logger.exception("omni master loop failed")
        finally:
            self._started.set()
            _finish_tasks(loop)
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        interceptors = [TokenInterceptor(self._token)] if self._token else []
        server = grpc.aio.server(interceptors=interceptors, options=server_options())
        servicer = self._servicer = MasterServicer(self.registry, self._kv)
        pb_grpc.add_MasterServicer_to_server(servicer, server)
        target = host_port(self.host, self.port)
        try:
            if self._tls is not None:
                port = server.add_secure_port(target, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise ConfigError(f"omni master cannot listen on {target}: {e}") from None
        if port == 0:
            raise ConfigError(f"omni master cannot listen on {target} (address in use or not local)")
        self.port = port
        await server.start()
        sweeper = asyncio.create_task(self._sweep(servicer))
        logger.info("omni master listening on %s (tls=%s, token=%s)", self.address, self._tls is not None,
                    bool(self._token))
        self._started.set()
        try:
            await self._stop_event.wait()
        finally:
            sweeper.cancel()
            await servicer.close()
            await server.stop(self._grace)

    async def _sweep(self, servicer: MasterServicer) -> None:
        tick = sweep_tick(self.registry.lease_ttl_s)
        while True:
            await asyncio.sleep(tick)
            try:
                servicer.publish(self.registry.sweep())
            except Exception:
                logger.exception("lease sweep failed")
