"""Clients of the master: `MasterClient` (sync, thread-safe, with a keep-alive thread) and
`AsyncMasterClient` (grpc.aio, for the asyncio HTTP frontends)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import AsyncIterator, Callable, Iterable

import grpc

from omni._proto import master_pb2 as pb
from omni import envs
from omni._proto import master_pb2_grpc as pb_grpc
from omni.digits import ascii_int
from omni.errors import BadRequest, OmniError, Unavailable
from omni.master import limits, wire
from omni.master.auth import TlsFiles, TlsRefused, call_metadata, explain
from omni.master.errors import ClosedByMaster, from_rpc_error
from omni.master.reach import Reachability
from omni.master.types import Command, CommandResult, Registration, Status, TopologyEvent
from omni.netaddr import is_ipv6

logger = logging.getLogger(__name__)

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 1.5
DEFAULT_TIMEOUT_S = 10.0

OnCommand = Callable[[Command], "tuple[bool, str] | Future | None"]   # a Future: acked once done


def check_address(address: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in address):   # a NUL reached gRPC's C core, which printed raw lines
        raise BadRequest(f"omni master address {address!r} holds a control character; give HOST:PORT")
    host, sep, port = address.rpartition(":")
    n = ascii_int(port)
    if not sep or not host or n is None or not 0 < n < 65536:
        raise BadRequest(f"omni master address must be HOST:PORT, got {address[:200]!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # gRPC read ::1:1 as the IPv6 address ::0.1.0.1 on port 443
        hint = f" (an IPv6 address goes in brackets: [{host}]:{port})" if is_ipv6(host) else ""
        raise BadRequest(f"omni master address must be HOST:PORT, got {address!r}{hint}")
    return address


def _channel(address: str, tls: TlsFiles | None, aio: bool = False):
    # gRPC's own reconnect backoff grows to 120 s; after a master restart that, not our
    # keep-alive backoff, would decide when stages re-register. Cap it at ours.
    options = [("grpc.keepalive_time_ms", limits.KEEPALIVE_MS), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_START_S * 1000)),
               ("grpc.min_reconnect_backoff_ms", int(BACKOFF_START_S * 1000)),
               ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_S * 1000)),
               ("grpc.max_receive_message_length", limits.MAX_RECEIVE_BYTES)]   # a full registry's status fits
    mod = grpc.aio if aio else grpc
    if tls is not None:
        return mod.secure_channel(address, tls.channel_credentials(), options=options)
    return mod.insecure_channel(address, options=options)


def _error(err: grpc.RpcError, address: str, tls: TlsFiles | None, streaming: bool = False) -> OmniError:
    """from_rpc_error, saying what a TLS failure means; a certificate failure is final (TlsRefused)."""
    if (err.code() if hasattr(err, "code") else None) is grpc.StatusCode.UNAVAILABLE:
        why = explain(err.details() or "", address, tls)
        if why is not None:
            return TlsRefused(why[0]) if why[1] else ClosedByMaster(why[0])
    return from_rpc_error(err, address, streaming)


class _Stream:
    """State of one keep-alive stream, shared by its request generator and its reader."""

    def __init__(self):
        self.done = False
        self.wake = threading.Event()


class TopologyWatch:
    """An iterator of TopologyEvents over one WatchTopology call; thread-safe cancel()."""

    def __init__(self, call, address: str, tls: TlsFiles | None = None):
        self._call = call
        self._address = address
        self._tls = tls

    def __iter__(self) -> "TopologyWatch":
        return self

    def __next__(self) -> TopologyEvent:
        try:
            return wire.event_from_pb(next(self._call))
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise _error(e, self._address, self._tls, streaming=True) from None

    def cancel(self) -> None:
        self._call.cancel()

    close = cancel

    def __enter__(self) -> "TopologyWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class MasterClient:
    def __init__(self, address: str, token: str | None = None, tls: TlsFiles | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.address = check_address(address)
        self._md = call_metadata(token)
        self._timeout = timeout_s
        self._tls = tls
        self._channel = _channel(address, tls)
        self._stub = pb_grpc.MasterStub(self._channel)
        self._lock = threading.Lock()
        self._reg_request: pb.RegisterRequest | None = None
        # Who we are to the master beyond host and pid: our launcher's id for us, if it started us.
        self._instance_id = envs.OMNI_INSTANCE_ID or uuid.uuid4().hex
        self._registration: Registration | None = None
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        self._ka_call = None
        self._stream: _Stream | None = None   # the keep-alive stream up now
        self._acks: queue.SimpleQueue[pb.CommandAck] = queue.SimpleQueue()
        self._last_load: dict | None = None   # load_fn's last good load, sent again when it fails
        self.last_error: str | None = None  # of the keep-alive loop, for diagnostics
        self.registrations = 0  # how many times register succeeded (re-registrations included)
        self.reach = Reachability(self.address, logger, BACKOFF_MAX_S)   # the keep-alive's view, logged

    def _unary(self, method, request, timeout: float | None = None, wait_for_ready: bool | None = None):
        try:
            return method(request, metadata=self._md, timeout=timeout or self._timeout,
                          wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise _error(e, self.address, self._tls) from None

    # -- registration -----------------------------------------------------------------------
    def register(self, role: str = "STAGE", stage_id: int = -1, *, config_hash: str,
                 pipeline_config: dict | None = None, endpoints: dict[str, str] | None = None,
                 replica_hint: int = -1, host: str | None = None, pid: int | None = None,
                 version: str | None = None, capabilities: dict | None = None,
                 wait_s: float | None = None, stop=None) -> Registration | None:
        """Register; `wait_s` waits that long for the master to come up instead of failing at once.
        `stop` (anything with is_set(): a stop request, an asyncio.Event) ends that wait within a
        second of being set -> None (Ctrl-C or a launcher's death must not wait out the 30-120 s)."""
        req = wire.register_request(role, stage_id, host, pid, replica_hint, endpoints, config_hash, pipeline_config,
                                version, capabilities, self._instance_id)
        resp = self._wait_register(req, wait_s, stop)
        if resp is None:
            return None
        reg = wire.registration_from_pb(resp)
        with self._lock:
            self._reg_request, self._registration = req, reg
            self.registrations += 1
        return reg

    def _wait_register(self, req, wait_s: float | None, stop):
        if not wait_s or stop is None:
            return self._unary(self._stub.Register, req, timeout=wait_s, wait_for_ready=bool(wait_s) or None)
        # Wait for the master in 1 s slices of an idempotent call (GetStatus), looking at `stop` between
        # them; Register itself is called once (retried, it could register twice with a master that is
        # only slow). No connectivity watcher: its thread outlives a quick close() with a traceback.
        deadline = time.monotonic() + wait_s
        last = ""
        while True:
            if stop.is_set():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"cannot reach the omni master at {self.address}: no answer within {wait_s:g} s"
                                  + (f"; the last try: {last}" if last else ""))
            try:
                self._unary(self._stub.GetStatus, pb.GetStatusRequest(), timeout=min(1.0, left), wait_for_ready=True)
                break
            except Unavailable:
                pass
            # wait_for_ready hides why the connection fails (a refused certificate, TlsRefused; plaintext to a
            # TLS master): ask without it too, and say the last answer if the wait runs out
            try:
                self._unary(self._stub.GetStatus, pb.GetStatusRequest(), timeout=1.0)
                break
            except Unavailable as e:
                last = str(e).removeprefix(f"cannot reach the omni master at {self.address}: ")
        return self._unary(self._stub.Register, req, timeout=max(1.0, deadline - time.monotonic()),
                           wait_for_ready=True)

    @property
    def registration(self) -> Registration | None:
        with self._lock:
            return self._registration

    def _reregister(self) -> Registration:
        with self._lock:
            req = pb.RegisterRequest()
            req.CopyFrom(self._reg_request)
            if self._registration is not None:
                req.replica_hint = self._registration.replica_index
        resp = self._unary(self._stub.Register, req)
        reg = wire.registration_from_pb(resp)
        with self._lock:
            self._registration = reg
            self.registrations += 1
        logger.info("re-registered with the omni master at %s as %s", self.address, reg.replica_id)
        return reg

    def deregister(self) -> bool:
        """Leave the pipeline. The keep-alive loop is told to stop first so it cannot re-register."""
        self._ka_stop.set()
        reg = self.registration
        try:
            if reg is None:
                return False
            resp = self._unary(self._stub.Deregister, pb.DeregisterRequest(lease_id=reg.lease_id))
            with self._lock:
                self._registration = None
            return resp.removed
        finally:
            self.stop_keepalive()

    # -- keep-alive -------------------------------------------------------------------------
    def start_keepalive(self, load_fn: Callable[[], dict], on_command: OnCommand, interval_s: float = 1.0,
                        on_registration: Callable[[Registration], None] | None = None,
                        withhold: Callable[[], str | None] | None = None) -> None:
        """Heartbeat from a daemon thread until stop_keepalive()/close(); reconnects with capped
        backoff and registers again (same slot hint) when the master lost the lease. No heartbeat
        while `withhold()` says why (a stuck stage loop): the lease expires."""
        if self.registration is None:
            raise OmniError("register() before start_keepalive()")
        if self._ka_thread is not None:
            raise OmniError("keep-alive already running")
        self._ka_stop.clear()
        self._withhold, self._withheld = withhold, None   # why heartbeats are withheld now
        self._ka_thread = threading.Thread(
            target=self._keepalive_loop, args=(load_fn, on_command, interval_s, on_registration),
            name="omni-master-keepalive", daemon=True)
        self._ka_thread.start()

    def stop_keepalive(self, timeout_s: float = 5.0) -> None:
        thread, self._ka_thread = self._ka_thread, None
        if thread is None:
            return
        self._ka_stop.set()
        call = self._ka_call
        if call is not None:
            call.cancel()
        thread.join(timeout_s)

    def _keepalive_loop(self, load_fn, on_command, interval_s, on_registration) -> None:
        backoff = BACKOFF_START_S
        need_register = False
        while not self._ka_stop.is_set():
            started = time.monotonic()
            try:
                if need_register:
                    reg = self._reregister()
                    self.reach.back()
                    need_register = False
                    backoff = BACKOFF_START_S
                    if on_registration is not None:
                        on_registration(reg)
                self._run_stream(load_fn, on_command, interval_s)
            except grpc.RpcError as e:
                if self._ka_stop.is_set():
                    break
                if e.code() is grpc.StatusCode.NOT_FOUND:
                    logger.warning("omni master at %s lost our lease (%s); registering again", self.address,
                                   e.details())
                    need_register = True
                    continue
                self.last_error = f"{e.code().name}: {e.details()}"
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.reach.lost(self.last_error)
                logger.log(logging.WARNING if e.code() is grpc.StatusCode.INVALID_ARGUMENT else logging.DEBUG,
                           "keep-alive stream to %s ended: %s", self.address, self.last_error)
            except Unavailable as e:   # registering again, with the master away: said once, not every try
                self.last_error = str(e)
                self.reach.lost(self.last_error)
            except Exception as e:  # never stop heartbeating over one failure
                self.last_error = str(e)
                logger.warning("keep-alive to the omni master at %s failed: %s", self.address, e)
            if time.monotonic() - started > 2 * BACKOFF_MAX_S:
                backoff = BACKOFF_START_S  # the stream had been healthy
            self._ka_stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _run_stream(self, load_fn, on_command, interval_s) -> None:
        reg = self.registration
        interval = max(0.02, min(interval_s, reg.lease_ttl_s / 3))
        stream = self._stream = _Stream()
        call = self._stub.KeepAlive(self._heartbeats(stream, reg, load_fn, interval), metadata=self._md)
        self._ka_call = call
        try:
            for cmd in call:
                ack = wire.ack_command(on_command, cmd, later=self._ack_later)
                if ack is not None:
                    self._acks.put(ack)
                    stream.wake.set()
        finally:
            stream.done = True
            stream.wake.set()
            self._ka_call = None

    def _ack_later(self, ack: pb.CommandAck) -> None:
        """A command's ack that came after the commands behind it (a QUIESCE's wait): the next heartbeat
        carries it, on whichever stream is up then (a master that no longer waits for it drops it)."""
        self._acks.put(ack)
        stream = self._stream
        if stream is not None:
            stream.wake.set()

    def _heartbeats(self, stream: _Stream, reg: Registration, load_fn, interval: float):
        while not stream.done and not self._ka_stop.is_set():
            stream.wake.clear()
            if not self._withholding():
                acks = []
                while True:
                    try:
                        acks.append(self._acks.get_nowait())
                    except queue.Empty:
                        break
                yield self._heartbeat(reg, load_fn, acks)
                # gRPC asks for the next heartbeat once this one was sent: the connection is up
                self.reach.back()
            stream.wake.wait(interval)

    def _withholding(self) -> bool:
        why = self._withhold() if self._withhold is not None else None
        if bool(why) != bool(self._withheld):
            if why:
                logger.error("%s: no heartbeats to the omni master until that ends (its lease expires; the "
                             "frontends move the requests that made no output yet)", why)
            else:
                logger.warning("heartbeating the omni master again (withheld while: %s)", self._withheld)
        self._withheld = why
        return bool(why)

    def _heartbeat(self, reg: Registration, load_fn, acks: list) -> pb.Heartbeat:
        """The load_fn's load; when it fails, the last good one, or none (no_load: the master keeps what it has;
        an empty load would read as not draining, awake)."""
        try:
            load = load_fn() or {}
            hb = wire.heartbeat_from_load(load, reg.lease_id, reg.replica_id, acks)
            self._last_load = load
            return hb
        except Exception as e:
            logger.warning("load_fn failed or gave a bad load, heartbeating with the last good one: %s", e)
        if self._last_load is not None:
            return wire.heartbeat_from_load(self._last_load, reg.lease_id, reg.replica_id, acks)
        return pb.Heartbeat(lease_id=reg.lease_id, replica_id=reg.replica_id, acks=acks, no_load=True)

    # -- queries and commands ---------------------------------------------------------------
    def get_status(self, timeout_s: float | None = None) -> Status:
        return wire.status_from_pb(self._unary(self._stub.GetStatus, pb.GetStatusRequest(), timeout=timeout_s))

    def watch(self, timeout_s: float | None = None) -> "TopologyWatch":
        """Topology events, a SNAPSHOT first; `timeout_s` bounds the whole watch (RequestTimeout).
        Iterate it; `cancel()` (from any thread) ends the iteration."""
        call = self._stub.WatchTopology(pb.WatchRequest(), metadata=self._md, timeout=timeout_s)
        return TopologyWatch(call, self.address, self._tls)

    def send_command(self, kind: str, stage_ids: Iterable[int] = (), args: dict | None = None,
                     timeout_s: float = 10.0, replica_ids: Iterable[str] = (),
                     keep_serving: bool = False) -> list[CommandResult]:
        req = wire.send_command_request(kind, stage_ids, args, timeout_s, replica_ids, keep_serving)
        return wire.results_from_pb(self._unary(self._stub.SendCommand, req, timeout=timeout_s + 5))

    def kv_put(self, namespace: str, key: str, value: bytes, only_if_exists: bool = False,
               only_if_absent: bool = False) -> bool:
        """Whether it wrote: `only_if_exists` writes only over a value the key holds now, `only_if_absent`
        only when it holds none."""
        req = pb.KvPutRequest(namespace=namespace, key=key, value=value, only_if_exists=only_if_exists,
                              only_if_absent=only_if_absent)
        return not self._unary(self._stub.KvPut, req).absent

    def kv_get(self, namespace: str, key: str) -> bytes | None:
        resp = self._unary(self._stub.KvGet, pb.KvGetRequest(namespace=namespace, key=key))
        return resp.value if resp.found else None

    def kv_list(self, namespace: str, prefix: str = "", max_entries: int = 100_000) -> dict[str, bytes]:
        """Every entry (page by page, up to max_entries)."""
        out: dict[str, bytes] = {}
        after = ""
        while len(out) < max_entries:
            resp = self._unary(self._stub.KvList, pb.KvListRequest(namespace=namespace, prefix=prefix,
                                                                   start_after=after))
            out.update((e.key, e.value) for e in resp.entries)
            after = resp.next_start_after
            if not after:
                break
        return out

    def kv_delete(self, namespace: str, key: str) -> bool:
        return self._unary(self._stub.KvDelete, pb.KvDeleteRequest(namespace=namespace, key=key)).deleted

    def close(self) -> None:
        """Stop heartbeating (the master marks us SUSPECT; deregister() first to leave cleanly)."""
        self.stop_keepalive()
        self._channel.close()

    def __enter__(self) -> "MasterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncMasterClient:
    """grpc.aio client for code on an asyncio loop. The channel is made on first use, on that loop."""

    def __init__(self, address: str, token: str | None = None, tls: TlsFiles | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.address = check_address(address)
        self._md = call_metadata(token)
        self._tls = tls
        self._timeout = timeout_s
        self._channel = None
        self._stub = None

    def _get_stub(self) -> pb_grpc.MasterStub:
        if self._stub is None:
            self._channel = _channel(self.address, self._tls, aio=True)
            self._stub = pb_grpc.MasterStub(self._channel)
        return self._stub

    async def _unary(self, name: str, request, timeout: float | None = None):
        method = getattr(self._get_stub(), name)
        try:
            return await method(request, metadata=self._md, timeout=timeout or self._timeout)
        except grpc.RpcError as e:
            raise _error(e, self.address, self._tls) from None

    async def get_status(self) -> Status:
        return wire.status_from_pb(await self._unary("GetStatus", pb.GetStatusRequest()))

    async def watch(self, timeout_s: float | None = None) -> AsyncIterator[TopologyEvent]:
        call = self._get_stub().WatchTopology(pb.WatchRequest(), metadata=self._md, timeout=timeout_s)
        try:
            async for msg in call:
                yield wire.event_from_pb(msg)
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.CANCELLED:
                raise _error(e, self.address, self._tls, streaming=True) from None
        finally:
            call.cancel()

    async def send_command(self, kind: str, stage_ids: Iterable[int] = (), args: dict | None = None,
                           timeout_s: float = 10.0, replica_ids: Iterable[str] = (),
                           keep_serving: bool = False) -> list[CommandResult]:
        req = wire.send_command_request(kind, stage_ids, args, timeout_s, replica_ids, keep_serving)
        return wire.results_from_pb(await self._unary("SendCommand", req, timeout=timeout_s + 5))

    async def kv_put(self, namespace: str, key: str, value: bytes, only_if_exists: bool = False,
                     only_if_absent: bool = False) -> bool:
        """Whether it wrote: `only_if_exists` writes only over a value the key holds now, `only_if_absent`
        only when it holds none."""
        req = pb.KvPutRequest(namespace=namespace, key=key, value=value, only_if_exists=only_if_exists,
                              only_if_absent=only_if_absent)
        return not (await self._unary("KvPut", req)).absent

    async def kv_get(self, namespace: str, key: str) -> bytes | None:
        resp = await self._unary("KvGet", pb.KvGetRequest(namespace=namespace, key=key))
        return resp.value if resp.found else None

    async def kv_list(self, namespace: str, prefix: str = "", max_entries: int = 100_000,
                      start_after: str = "") -> dict[str, bytes]:
        """Every entry after `start_after` in key order (page by page, up to max_entries)."""
        out: dict[str, bytes] = {}
        after = start_after
        while len(out) < max_entries:
            resp = await self._unary("KvList", pb.KvListRequest(namespace=namespace, prefix=prefix, start_after=after,
                                                                limit=max_entries - len(out)))
            out.update((e.key, e.value) for e in resp.entries)
            after = resp.next_start_after
            if not after:
                break
        return out

    async def kv_delete(self, namespace: str, key: str) -> bool:
        return (await self._unary("KvDelete", pb.KvDeleteRequest(namespace=namespace, key=key))).deleted

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
