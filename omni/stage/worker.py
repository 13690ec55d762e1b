"""StageWorker: one stage replica's loop around an Engine.

The worker owns a ZMQ ROUTER socket (one DEALER per frontend connects to it),
the engine, the tensor producers for its outputs and a consumer for its inputs.
The loop: drain incoming messages without blocking while the engine has work,
step the engine, send each output back to the frontend that sent the request.
Master commands arrive on the keep-alive thread and are queued to the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from omni.config import StageConfig
from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from omni.stage import messages as m
from omni.transport.base import TensorProducer, TransportError

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    frontend: bytes
    added_at: float
    out_transport: str
    out_tensors: bool = True
    started: bool = False


@dataclass
class WorkerStats:
    requests_total: int = 0
    errors_total: int = 0
    steps: int = 0
    step_s_total: float = 0.0
    tensor_bytes_out: int = 0
    tensor_bytes_in: int = 0


@dataclass
class _Command:
    kind: str
    args: dict
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True
    message: str = ""


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
    ):
        self.stage = stage
        self.engine = engine
        self.token = token
        self.replica_id = replica_id
        self.default_transport = default_transport
        self._make_producer = make_producer
        self._producers: dict[str, TensorProducer] = {}
        self._consumer = consumer
        self._reqs: dict[str, _Req] = {}
        self._frontends: set[bytes] = set()
        self._commands: "queue.Queue[_Command]" = queue.Queue()
        self._stopping = threading.Event()
        self.draining = False
        self.fatal: str | None = None      # why the engine can serve no more (set by _step)
        self.stats = WorkerStats()
        self._codec = m.stage_codec()
        self._out = m.Codec(m.ToStage)   # encoder side only
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host or host}:{port}"
        # A command from another thread wakes the loop through this pair.
        self._wake_addr = f"inproc://omni-stage-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()

    # ------------------------------------------------------------ threads

    def load(self) -> dict:
        """Keep-alive payload (read from the keep-alive thread; plain ints)."""
        return {
            "queue_len": self.engine.num_waiting(),
            "in_flight": len(self._reqs),
            "requests_total": self.stats.requests_total,
            "cpu_seconds": time.process_time(),
            "is_sleeping": self.engine.is_sleeping(),
            "draining": self.draining,
            "extra": {
                "steps": float(self.stats.steps),
                "step_s_total": self.stats.step_s_total,
                "tensor_bytes_out": float(self.stats.tensor_bytes_out),
                "tensor_bytes_in": float(self.stats.tensor_bytes_in),
            },
        }

    def command(self, kind: str, args: dict | None = None, timeout: float = 60.0) -> tuple[bool, str]:
        """Run a master command on the loop thread and wait for its result."""
        cmd = _Command(kind.upper(), args or {})
        self._commands.put(cmd)
        self._wake()
        if not cmd.done.wait(timeout):
            return False, f"{kind} did not finish within {timeout:.0f} s"
        return cmd.ok, cmd.message

    def stop(self) -> None:
        self._stopping.set()
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ------------------------------------------------------------ loop

    def run(self, grace_s: float = 5.0) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        stop_deadline: float | None = None
        while True:
            busy = self.engine.has_unfinished() and not self.engine.is_sleeping()
            events = dict(poller.poll(0 if busy else 1000))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._sock in events:
                self._drain_socket()
            self._run_commands()
            if self._stopping.is_set():
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + grace_s
                    logger.info("%s: stopping, %d request(s) in flight", self.stage.label, len(self._reqs))
                if not self._reqs or time.monotonic() > stop_deadline:
                    break
            if self.engine.has_unfinished() and not self.engine.is_sleeping():
                self._step()
        for rid in list(self._reqs):
            self._fail(rid, f"{self.stage.label} is shutting down")
        self.close()

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("%s: dropped a message with %d frames", self.stage.label, len(frames))
                continue
            ident, payload = frames[0].bytes, frames[1].buffer
            try:
                msg = self._codec.decode(payload)
            except Exception as e:  # msgspec.DecodeError / ValidationError
                logger.warning("%s: undecodable message from %r: %s", self.stage.label, ident, e)
                continue
            self._handle(ident, msg)

    def _handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, m.Hello):
            ok = not self.token or msg.token == self.token
            if ok:
                self._frontends.add(ident)
            else:
                logger.warning("%s: refused frontend %s: bad token", self.stage.label, msg.frontend_id)
            self._send(ident, m.Welcome(self.stage.stage_id, self.replica_id, ok=ok,
                                        error="" if ok else "bad data-plane token"))
            return
        if self.token and ident not in self._frontends:
            return   # unauthenticated peer: ignore everything
        if isinstance(msg, m.AddRequest):
            self._add(ident, msg)
        elif isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                if self._reqs.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self._free_owner(rid)
        elif isinstance(msg, m.FreeTensors):
            producer = self._producers.get(msg.transport)
            if producer is not None:
                producer.free(msg.keys)
        elif isinstance(msg, m.Utility):
            self._utility(ident, msg)

    def _add(self, ident: bytes, msg: m.AddRequest) -> None:
        rid = msg.request_id
        if self.draining or self._stopping.is_set():
            self._send(ident, self._error(rid, f"{self.stage.label} is draining"))
            return
        try:
            tensors = {}
            for name, ref in msg.tensors.items():
                if self._consumer is None:
                    raise TransportError("this stage has no tensor consumer")
                tensors[name] = self._consumer.get(ref)
                self.stats.tensor_bytes_in += ref.nbytes
            req = EngineRequest(
                request_id=rid,
                prompt_token_ids=msg.prompt_token_ids,
                text=msg.text,
                sampling=msg.sampling,
                tensors=tensors,
                extra=msg.extra,
            )
            self.engine.add_request(req)
        except (EngineError, TransportError, ValueError, TypeError) as e:
            self.stats.errors_total += 1
            self._send(ident, self._error(rid, f"{type(e).__name__}: {e}"))
            return
        if rid not in self._reqs:
            self.stats.requests_total += 1
            self._reqs[rid] = _Req(ident, time.monotonic(), msg.out_transport or self.default_transport,
                                  msg.out_tensors)

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # An engine step that raises fails every request it held; the loop lives,
            # unless the error says the engine is gone for good (`fatal = True`, e.g. a
            # dead vLLM EngineCore): then the loop stops and the process exits non-zero.
            logger.exception("%s: engine step failed", self.stage.label)
            for rid in list(self._reqs):
                self.engine.abort(rid)
                self._fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            if getattr(e, "fatal", False):
                self.fatal = f"{type(e).__name__}: {e}"
                self._stopping.set()
            return
        dt = time.monotonic() - t0
        self.stats.steps += 1
        self.stats.step_s_total += dt
        for out in outputs:
            self._emit(out, dt)

    def _emit(self, out: EngineOutput, step_s: float) -> None:
        req = self._reqs.get(out.request_id)
        if req is None:
            return  # aborted meanwhile
        if out.error:
            self._fail(out.request_id, out.error)
            return
        queue_s = None
        if not req.started:
            req.started = True
            queue_s = max(0.0, time.monotonic() - req.added_at - step_s)
        try:
            refs = {}
            for name, tensor in (out.tensors.items() if req.out_tensors else ()):
                ref = self._producer(req.out_transport).put(tensor, owner=out.request_id)
                self.stats.tensor_bytes_out += ref.nbytes
                refs[name] = ref
        except (TransportError, ValueError) as e:
            self.engine.abort(out.request_id)
            self._fail(out.request_id, f"could not publish output tensors: {e}")
            return
        msg = m.Output(
            request_id=out.request_id,
            token_ids=out.token_ids,
            text=out.text,
            tensors=refs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            queue_s=queue_s,
            step_s=step_s,
            sent_at=time.time(),
        )
        if out.finished:
            del self._reqs[out.request_id]
        self._send(req.frontend, msg)

    def _producer(self, kind: str) -> TensorProducer:
        producer = self._producers.get(kind)
        if producer is None:
            if self._make_producer is None:
                raise TransportError("this stage has no tensor producer")
            producer = self._producers[kind] = self._make_producer(kind)
        return producer

    def _free_owner(self, rid: str) -> None:
        for producer in self._producers.values():
            producer.free_owner(rid)

    def _fail(self, rid: str, message: str) -> None:
        req = self._reqs.pop(rid, None)
        self.stats.errors_total += 1
        self._free_owner(rid)
        if req is not None:
            self._send(req.frontend, self._error(rid, message))

    def _error(self, rid: str, message: str) -> m.RequestError:
        return m.RequestError(rid, message, self.stage.stage_id, self.replica_id)

    def _send(self, ident: bytes, msg: Any) -> None:
        try:
            self._sock.send_multipart([ident, self._out.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            # Frontend gone (EHOSTUNREACH) or its queue full: its requests die with it.
            logger.warning("%s: cannot reach frontend %r: %s", self.stage.label, ident, e)
            for rid, req in list(self._reqs.items()):
                if req.frontend == ident:
                    self._reqs.pop(rid)
                    self.engine.abort(rid)
                    self._free_owner(rid)

    # ------------------------------------------------------------ utilities / commands

    def _call(self, method: str, args: dict) -> Any:
        if method == "sleep":
            self.engine.sleep(int(args.get("level", 1)))
            return {"is_sleeping": self.engine.is_sleeping()}
        if method == "wake_up":
            self.engine.wake_up()
            return {"is_sleeping": self.engine.is_sleeping()}
        if method == "is_sleeping":
            return self.engine.is_sleeping()
        if method == "stats":
            return {**self.engine.stats(), **self.load()["extra"]}
        if method == "ping":
            return "pong"
        raise EngineError(f"unknown utility method {method!r}")

    def _utility(self, ident: bytes, msg: m.Utility) -> None:
        try:
            result = self._call(msg.method, msg.args)
            self._send(ident, m.UtilityResult(msg.call_id, True, result))
        except Exception as e:
            self._send(ident, m.UtilityResult(msg.call_id, False, None, f"{type(e).__name__}: {e}"))

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if cmd.kind == "SLEEP":
                    self._call("sleep", cmd.args)
                    cmd.message = "sleeping"
                elif cmd.kind == "WAKE_UP":
                    self._call("wake_up", cmd.args)
                    cmd.message = "awake"
                elif cmd.kind == "DRAIN":
                    self.draining = True
                    cmd.message = "draining"
                elif cmd.kind == "SHUTDOWN":
                    self._stopping.set()
                    cmd.message = "shutting down"
                else:
                    raise EngineError(f"unknown command {cmd.kind}")
            except Exception as e:
                cmd.ok, cmd.message = False, f"{self.stage.label}: {e}"
            cmd.done.set()

    def close(self) -> None:
        for producer in self._producers.values():
            try:
                producer.close()
            except Exception:
                logger.exception("closing a tensor producer")
        self._producers.clear()
        if self._consumer is not None:
            self._consumer.close()
        self.engine.shutdown()
        self._sock.close(0)
        self._wake_rx.close(0)
        self._wake_tx.close(0)
