"""StageWorker: one stage replica's loop around an Engine.

The worker owns a ZMQ ROUTER socket (one DEALER per frontend connects to it) and,
with `local_channel`, a LocalListener for frontends on its host (omni/stage/local_link.py),
the engine, the tensor producers for its outputs and a consumer for its inputs.
The loop: drain incoming messages without blocking while the engine has work,
step the engine, send each output back to the frontend that sent the request.
What each incoming message does (the Hello, taking a request in or refusing it) is omni/stage/intake.py.
Master commands arrive on the keep-alive thread and are queued to the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import zmq

from omni import latency_trace
from omni.config import StageConfig
from omni.netaddr import bracketed, host_port, is_ipv6
from omni.ratelog import RateLimitedLog
from omni.signals import StopRequest
from omni.engines.base import Engine, EngineOutput
from omni.stage import held, intake, messages as m
from omni.stage.control import StageControl
from omni.stage.expiry import IdleRequests, sweep
from omni.stage.holds import Holds
from omni.stage.input_reads import InputReads
from omni.stage.local_link import CLOSED, LocalPeers
from omni.stage.loop_poll import LoopPoller
from omni.stage.loop_watch import LoopWatch
from omni.stage.worker_state import HeldOutput, InFlight, LoadSnapshot, RecentBases, WorkerStats, load_report
from omni.stage.curve import secure_server
from omni.stage.producers import OutputProducers
from omni.stage.published import Published
from omni.transport.base import ProducerFull, TensorProducer, TransportError
from omni.transport.local import PeerClosed

logger = logging.getLogger(__name__)

# With an engine that has a ready_fd: how often it is stepped while work is in flight
# and it says nothing (its step() checks that it is alive).
STEP_IDLE_S = 0.1


class StageWorker:
    def __init__(
        self,
        stage: StageConfig,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        token: str = "",
        default_transport: str = "shm",
        make_producer: Callable[[str], TensorProducer] | None = None,
        consumer: Any = None,
        replica_id: str = "",
        stall_timeout_s: float = 60.0,
        loop_stall_s: float = 120.0,
        published_ttl_s: float = 300.0,
        stop_request: StopRequest | None = None,
        local_channel: bool = False,
    ):
        self.stage = stage
        self.engine = engine
        self.token = token
        self.replica_id = replica_id
        self.default_transport = default_transport
        self._producers = OutputProducers(make_producer, stage.devices, stage.label)
        self._consumer = consumer
        self._reqs: dict[str, InFlight] = {}
        # published_ttl_s is the pipeline's request_timeout_s: past it, the tensors of a request done here that
        # no frontend freed are freed (published.py), an open request nothing touched is dropped (expiry.py)
        self._published = Published(published_ttl_s)
        self._idle = IdleRequests(published_ttl_s)
        self._recent = RecentBases()   # requests taken lately: draining refuses only others
        self._holds = Holds(engine)
        # Backpressure: while anything is held, the engine is not stepped, so memory
        # stays bounded by the producers' limits plus one step's output.
        self._held: deque[HeldOutput] = deque()
        self._stall_started: float | None = None
        self._flushing = False
        self._full_since: dict[bytes, float] = {}   # frontend -> its first refused send since it took one
        self._owed = held.Owed(published_ttl_s)     # error frames owed to frontends dropped for reading nothing
        self.stall_timeout_s = stall_timeout_s
        self._stop_request = stop_request    # set by a signal handler; polled by the loop
        self._frontends: set[bytes] = set()
        self.control = StageControl(self)
        self._stopping = threading.Event()
        self.draining = False
        self.fatal: str | None = None      # why the engine can serve no more (set by _step)
        self.stats = WorkerStats()
        # Steps are timed where the engine computes in this process (vLLM's run in its EngineCore).
        self._time_steps = engine.ready_fd() is None
        self._codec = m.stage_codec()
        self._out = m.Codec(m.ToStage)   # encoder side only
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure_server(self._sock, token)   # CURVE: each connection proves the token; size cap
        self._bad_frames = RateLimitedLog(logger)
        if is_ipv6(host):
            self._sock.setsockopt(zmq.IPV6, 1)   # libzmq binds an IPv6 address only with it on
        port = self._sock.bind_to_random_port(f"tcp://{bracketed(host)}")
        self.endpoint = f"tcp://{host_port(advertise_host or host, port)}"
        # The loop waits here; a command from another thread wakes it (`_wake`).
        self._poll = LoopPoller(self._sock)
        self._reads = InputReads(consumer, self._wake)   # remote inputs are read off the loop
        # Same-host frontends connect here; `local_endpoint` goes beside `endpoint` in the registration.
        self._local = LocalPeers(token, self._wake) if local_channel else None
        self.local_endpoint = self._local.endpoint if self._local is not None else ""
        self.load_snapshot = LoadSnapshot(self)   # what the keep-alive sends: it never calls into the engine
        self.loop_watch = LoopWatch(loop_stall_s, stage.label)   # the keep-alive stops heartbeating while wedged
        engine.progress_hook = self.loop_watch.progressed       # marks from inside a long step (engines/base.py)

    # ------------------------------------------------------------ threads

    def load(self) -> dict:
        """The load now (loop thread only; the keep-alive thread reads `load_snapshot`)."""
        return load_report(self)

    def command(self, kind: str, args: dict | None = None, timeout: float = 60.0) -> tuple[bool, str]:
        """Run a master command on the loop thread and wait for its result."""
        return self.control.submit(kind, args, timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._wake()

    def _wake(self) -> None:
        self._poll.wake()

    # ------------------------------------------------------------ loop

    def run(self, grace_s: float = 5.0) -> None:
        poller = self._poll
        if self._local is not None:
            self._local.attach(poller)
        # An engine that says when it has output is stepped then (and every STEP_IDLE_S,
        # so a dead engine is noticed), not in a loop that polls it.
        ready_fd = self.engine.ready_fd()
        watching = False   # the fd is in the poller (not while output is held: it stays readable)
        busy_timeout = 0 if ready_fd is None else int(STEP_IDLE_S * 1000)
        last_step = time.monotonic()
        stop_fd = self._stop_request.fileno() if self._stop_request is not None else None
        if stop_fd is not None:
            poller.register(stop_fd)
        stop_deadline: float | None = None
        while True:
            self.load_snapshot.due()
            busy = self.engine.has_unfinished() and not self.engine.is_sleeping()
            if not busy or self._held:
                self.loop_watch.waiting()
            # Held output is retried every few ms (a full frontend queue gives no event);
            # a FreeTensors from a consumer wakes the poll at once.
            timeout = 5 if self._held else (busy_timeout if busy else self._holds.idle_ms())
            if self._local is not None:
                self._local.watch_writable()
            if ready_fd is not None and watching == bool(self._held):
                watching = not self._held
                if watching:
                    poller.register(ready_fd)
                else:
                    poller.unregister(ready_fd)
            router_ready, woke, events = poller.poll(timeout, self._local is not None and self._local.connected)
            if woke and self._local is not None:
                self._local.accept()
            if router_ready:
                self._drain_socket()
            if self._local is not None and events:
                self._local.service(events, self._receive, self._frontend_gone)
            for ident, msg, read in self._reads.ready():
                if not self._recent.ended(msg.request_id) and not intake.refused(self, ident, msg.request_id, False):
                    intake.admit(self, ident, msg, read)
            if self.control.pending:
                self.control.run_pending()
            if self._stop_request is not None and self._stop_request.is_set():
                self._stopping.set()
                if stop_fd is not None:   # never drained: it would end every later poll at once
                    poller.unregister(stop_fd)
                    stop_fd = None
            if self._held:
                self._flush_held()
            sweep(self)
            if self._stopping.is_set():
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + grace_s
                    logger.info("%s: stopping, %d request(s) in flight", self.stage.label, len(self._reqs))
                if (not self._reqs and not self._held and not self._reads) or time.monotonic() > stop_deadline:
                    break
            if self._held:
                continue
            if ready_fd is not None and ready_fd in events:
                # Also with nothing in flight: output of an aborted request must be read
                # (the fd would stay readable).
                last_step = time.monotonic()
                self._step()
            elif self.engine.has_unfinished() and not self.engine.is_sleeping():
                if ready_fd is None or time.monotonic() - last_step >= STEP_IDLE_S:
                    last_step = time.monotonic()
                    self._step()
        self.fail_all(self._reads.close(), f"{self.stage.label} is shutting down", abort=False)   # reads: not ended
        self.close()

    def fail_all(self, waiting: list[tuple[bytes, str]], why: str, abort: bool) -> None:
        """Every request ends with `why`: `waiting` (reads not ended), then those taken (`abort`: engine lives on)."""
        for ident, rid in waiting:
            if rid not in self._reqs:
                self.stats.errors_total += 1
                self._send(ident, self._error(rid, why, "unavailable"))
        for rid in list(self._reqs):
            if abort:
                self.engine.abort(rid)
            self._fail(rid, why, "unavailable")

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad_frames.warning("%s: dropped a message with %d frames", self.stage.label, len(frames))
                continue
            self._receive(frames[0].bytes, frames[1].buffer)

    def _receive(self, ident: bytes, payload) -> None:
        try:
            msg = self._codec.decode(payload)
        except Exception as e:  # msgspec.DecodeError / ValidationError
            self._bad_frames.warning("%s: undecodable message from %r: %s", self.stage.label, ident[:64], e)
            return
        self._handle(ident, msg)

    def _handle(self, ident: bytes, msg: Any) -> None:
        intake.handle(self, ident, msg)

    def _step(self) -> None:
        ready = self.engine.num_running() if self._time_steps else 0
        t0 = time.monotonic()
        self.loop_watch.stepping()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._engine_failed(e, "step")
            return
        if outputs or self._time_steps:   # a step of vLLM's returns at once: only its output says its core moved
            self.loop_watch.progressed()
        dt = time.monotonic() - t0
        self.stats.steps += 1
        self.stats.step_s_total += dt
        if self._time_steps:
            # The requests this step advanced: those it made output for (Piper's engines step one
            # at a time), else those the engine had ready (a batched talker between code chunks).
            batch = len({o.request_id for o in outputs}) or ready
            if batch:
                self.stats.engine_step(dt, batch)
        for out in outputs:
            self._emit(out, dt)

    def _engine_failed(self, e: Exception, what: str, fail_all: bool = True) -> None:
        """An engine call raised (in its except block). A step's error, or any that says the engine is gone
        for good (`fatal = True`, e.g. a dead vLLM EngineCore), fails every request it held with the cause;
        a fatal one also stops the loop (the process exits non-zero), else the loop lives."""
        logger.exception("%s: engine %s failed", self.stage.label, what)
        fatal = getattr(e, "fatal", False)
        if fail_all or fatal:
            for rid in list(self._reqs):
                self.engine.abort(rid)
                self._fail(rid, f"engine {what} failed: {type(e).__name__}: {e}")
        if fatal:
            self.fatal = f"{type(e).__name__}: {e}"
            self._stopping.set()

    def _emit(self, out: EngineOutput, step_s: float) -> None:
        if out.finished:
            self._recent.end(out.request_id)
            self._holds.end(out.request_id)
        # Nothing overtakes held output, so while anything is held this output waits too.
        if self._held or not self._publish(out, step_s):
            req = self._reqs.get(out.request_id)
            held.hold(self, HeldOutput(out.request_id, time.monotonic(), req.frontend if req else b"",
                                       out=out, step_s=step_s))

    def _publish(self, out: EngineOutput, step_s: float) -> bool:
        """Send one output; False when its tensors do not fit yet (nothing was kept)."""
        req = self._reqs.get(out.request_id)
        if req is None:
            return True  # aborted meanwhile
        if out.error:
            self._fail(out.request_id, out.error)
            return True
        try:   # all of its tensors or none
            refs = self._producers.put_all(req, out.tensors if req.out_tensors else {}, out.request_id)
        except ProducerFull:
            return False
        except Exception as e:   # any error of a producer fails this request only
            logger.warning("%s: publishing %s failed", self.stage.label, out.request_id,
                           exc_info=not isinstance(e, TransportError))
            self.engine.abort(out.request_id)
            self._fail(out.request_id, f"could not publish output tensors: {type(e).__name__}: {e}")
            return True
        self._published.add(req.frontend, out.request_id, refs.values())
        for r in refs.values():
            self.stats.tensor_bytes_out += r.nbytes
            self.stats.count(f"tensor_bytes_out.{r.transport}", r.nbytes)
        queue_s = None
        req.touched_at = time.monotonic()
        if not req.started:
            req.started = True
            queue_s = max(0.0, time.monotonic() - req.added_at - step_s)
            if not out.finished:
                self._holds.begin(out.request_id, req.hold_s)
        msg = m.output_of(out, refs, queue_s, step_s)
        if out.finished:
            del self._reqs[out.request_id]
        self._send(req.frontend, msg)
        if latency_trace.on():
            latency_trace.mark("sent", out.request_id, len(out.token_ids))
        return True

    def _flush_held(self) -> None:
        held.flush(self)

    def _free_owner(self, rid: str) -> None:
        self._producers.free_owner(rid)
        self._published.forget(rid)

    def _fail(self, rid: str, message: str, kind: str = "internal") -> None:
        req = self._reqs.pop(rid, None)
        self.stats.errors_total += 1
        if req is not None:     # first: a frontend's read of a tensor freed below then likely ends after it
            self._send(req.frontend, self._error(rid, message, kind))
        self._free_owner(rid)

    def _error(self, rid: str, message: str, kind: str = "internal") -> m.RequestError:
        return m.RequestError(rid, message, self.stage.stage_id, self.replica_id, kind)

    def _send(self, ident: bytes, msg: Any) -> None:
        frame = self._out.encode(msg)
        rid = getattr(msg, "request_id", "")   # request messages keep their order; replies need not
        if (rid and self._held and not self._flushing) or not held.send(self, ident, frame):
            h = HeldOutput(rid, time.monotonic(), ident, frame=frame)
            if self._flushing:
                self._held.appendleft(h)   # the head's own message: keeps the order
            else:
                held.hold(self, h)

    def _send_frame(self, ident: bytes, frame: bytes) -> bool:
        """False when the frontend's queue is full (it reads slowly): the caller holds the frame."""
        link = self._local.link(ident) if self._local is not None else None
        # Counted before the send (taken back if it fails): the peer may read the count as soon as it has the message.
        if link is not None:
            self.stats.count("channel_msgs_out.local", 1)
            try:
                if not self._local.send(link, frame):
                    self.stats.count("channel_msgs_out.local", -1)
                    return False
            except TransportError as e:
                self.stats.count("channel_msgs_out.local", -1)
                self._frontend_gone(ident, CLOSED if isinstance(e, PeerClosed) else str(e))
                return True
            except ValueError as e:   # over the size cap: ZMQ would drop the whole connection
                self.stats.count("channel_msgs_out.local", -1)
                self._bad_frames.warning("%s: dropped a message to %r: %s", self.stage.label, ident, e)
                return True
            return True
        self._poll.touched = True   # a send may take in the ROUTER's notice of a new message
        self.stats.count("channel_msgs_out.zmq", 1)
        try:
            self._sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            self.stats.count("channel_msgs_out.zmq", -1)
            return False
        except zmq.ZMQError as e:   # EHOSTUNREACH
            self.stats.count("channel_msgs_out.zmq", -1)
            self._frontend_gone(ident, str(e))
            return True
        return True

    def _frontend_gone(self, ident: bytes, why: str) -> None:
        """Its requests and held frames die with it. (A ZMQ identity stays admitted: its DEALER
        reconnects on its own, without a new Hello; a local ident is never used again.)"""
        logger.log(logging.INFO if why == CLOSED else logging.WARNING, "%s: frontend %r is gone: %s",
                   self.stage.label, ident, why)
        if self._local is not None and self._local.link(ident) is not None:
            self._local.drop(ident)
            self._frontends.discard(ident)
        self._held = deque(h for h in self._held if h.ident != ident)
        self._reads.frontend_gone(ident)
        self._full_since.pop(ident, None)
        self._owed.forget(ident)
        for rid, req in list(self._reqs.items()):
            if req.frontend == ident:
                self._reqs.pop(rid)
                self.engine.abort(rid)
                self._free_owner(rid)
        for rid in self._published.of_frontend(ident):   # done here, their tensors unfreed
            self._free_owner(rid)

    def close(self) -> None:
        self._producers.close()
        if self._consumer is not None:
            self._consumer.close()
        self.engine.shutdown()
        if self._local is not None:
            self._local.close()
        self._sock.close(0)
        self._poll.close()
