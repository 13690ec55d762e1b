"""Orchestrator: one per frontend process.

It owns the stage channels, the topology subscription and each request's queue, and
carries out what the socket-free core (omni/orchestrator/core.py) decides: stage
outputs, stage errors, replicas that go away and clients that leave are fed to the
core as events; the actions it returns (send, free, abort, emit, fail, finished) are
applied here, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq.asyncio

from omni.config import DeployConfig
from omni.errors import ConfigError, Conflict, OmniError, RequestTimeout, StageFailed, Unavailable
from omni.master.types import ReplicaInfo, TopologyEvent
from omni.metrics import labels
from omni.orchestrator import events as ev
from omni.orchestrator import quiesce
from omni.orchestrator.channel import BaseChannel, StageChannel
from omni.orchestrator.local_channel import LocalStageChannel
from omni.orchestrator.core import OrchestratorCore, load_processor
from omni.orchestrator.fetch import Fetcher, fill, on_loop
from omni.orchestrator.limits import check_inline
from omni.orchestrator.metrics import OrchestratorMetrics, render_engine_steps
from omni.orchestrator.picking import process
from omni.orchestrator.request_state import reads_from
from omni.orchestrator.topology import GONE, Topology
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from omni.stage import messages as m
from omni.stage.local_link import local_enabled, same_host_name
from omni.transport.base import TensorRef

logger = logging.getLogger(__name__)

__all__ = ["Orchestrator", "load_processor"]


def as_error(e: BaseException) -> OmniError:
    return e if isinstance(e, OmniError) else OmniError(f"{type(e).__name__}: {e}")


class _Sink:
    """Where one request's outputs wait for its generator."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.outcome: str | None = None     # the core's, once the request left it (Finished)


class _Lingering:
    """A gone replica whose channel stays open: its process, and the requests that may read what it published
    (found once when it went, plus any it sends to since), so a stage message checks these, not every request."""

    __slots__ = ("process", "readers")

    def __init__(self, process: tuple, readers: dict[str, None]):
        self.process = process
        self.readers = readers


class Orchestrator:
    def __init__(
        self,
        config: DeployConfig,
        *,
        frontend_id: str,
        topology: Topology,
        detokenize: Callable[[list[int]], str],
        consumer: Any = None,
        token: str = "",
        host: str = "127.0.0.1",
        master: Any = None,
        choose_transport: Callable[[str, str, str | None], str] | None = None,
    ):
        self.config = config
        self.frontend_id = frontend_id
        self.metrics_label: str | None = None
        self.topology = topology
        self.consumer = consumer
        self.token = token
        self.host = host
        self.master = master
        self.gate = quiesce.Gate()            # QUIESCE from the master (frontend.py): new requests refused
        self.metrics = OrchestratorMetrics()
        self.core = OrchestratorCore(config, topology=topology, detokenize=detokenize, host=host,
                                     choose_transport=choose_transport, metrics=self.metrics)
        self._ctx = zmq.asyncio.Context()
        self._channels: dict[str, BaseChannel] = {}
        # SUSPECT or DEAD replicas (picking.process) whose channel stays open while tensors they published are read.
        self._lingering: dict[str, _Lingering] = {}
        self._local = local_enabled()     # OMNI_STAGE_CHANNEL: same-host replicas over LocalChannel
        self._sinks: dict[str, _Sink] = {}
        self._fetch = Fetcher()           # remote and large output tensors are read off the loop
        self._apply_handlers = {ev.Send: self._do_send, ev.Free: self._do_free, ev.AbortStage: self._do_abort,
                                ev.ReleaseHold: self._do_release,
                                ev.Emit: self._do_emit, ev.Fail: self._do_fail, ev.Finished: self._do_finished}
        topology.on_change(self._on_topology)

    # ------------------------------------------------------------ events in

    def _on_topology(self, r: ReplicaInfo, kind: str) -> None:
        if r.role != "STAGE":
            return
        if kind != "REMOVED" and r.state not in GONE:
            was = self._lingering.pop(r.replica_id, None)
            if was is not None and was.process != process(r):     # restarted under its id: its keys are others'
                self._close(r.replica_id)
            return     # back: its channel serves again
        why = "gone" if kind == "REMOVED" else r.state.lower()
        # Before its channel closes, so the Aborts of what the core fails or moves off this replica
        # go out on it (flushed at close): a SUSPECT replica may be alive and would hold them forever.
        self._apply(self.core.handle(ev.ReplicaGone(r, why)))
        if kind == "REMOVED":
            self._lingering.pop(r.replica_id, None)
            self._close(r.replica_id)
        elif r.replica_id in self._channels:
            # A same-host stage frees all it published to a frontend whose channel closes, and one SUSPECT
            # or DEAD may be alive: what a later stage (or a read here) views would be reused under it.
            readers = {rid: None for rid, state in self.core.requests.items() if reads_from(state, r.replica_id)}
            self._lingering[r.replica_id] = _Lingering(process(r), readers)
            self._close_unread()

    def _close(self, replica_id: str) -> None:
        ch = self._channels.pop(replica_id, None)
        if ch is not None:
            ch.close()

    def _reads_from(self, replica_id: str, readers: dict[str, None]) -> bool:
        if self._fetch.reading_from(replica_id):
            return True
        while readers:     # one that stopped reading is dropped: amortised O(1) a call
            rid = next(iter(readers))
            state = self.core.requests.get(rid)
            if state is not None and reads_from(state, replica_id):
                return True
            del readers[rid]
        return False

    def _close_unread(self) -> None:
        """Close the channels of gone replicas whose tensors nothing reads any more (their frees went out)."""
        for rid in [rid for rid, g in self._lingering.items() if not self._reads_from(rid, g.readers)]:
            del self._lingering[rid]
            self._close(rid)

    def _on_channel_lost(self, ch: BaseChannel, why: str) -> None:
        """A same-host replica's end closed (it died or stopped): its requests move or fail now,
        as they would when the master's lease expires, and it is SUSPECT in this frontend's view
        until the master says otherwise, so no new request is sent there meanwhile."""
        if self._channels.get(ch.replica_id) is ch:
            del self._channels[ch.replica_id]
            self._lingering.pop(ch.replica_id, None)
        r = self.topology.replicas.get(ch.replica_id)
        if r is None:
            return
        self._apply(self.core.handle(ev.ReplicaGone(r, "gone (its channel closed)")))
        if r.state not in GONE:
            self.topology.apply(TopologyEvent("UPDATED", [msgspec.structs.replace(r, state="SUSPECT")], -1))

    def _on_local_fallback(self, ch: BaseChannel, other: BaseChannel) -> None:
        if self._channels.get(ch.replica_id) is ch:
            self._channels[ch.replica_id] = other
        else:       # replaced or gone meanwhile
            other.close()

    def _on_stage_message(self, ch: BaseChannel, msg: Any) -> None:
        if isinstance(msg, m.Output):
            event = ev.StageOutput(ch.replica_id, ch.stage_id, msg)
        elif isinstance(msg, m.RequestError):
            event = ev.StageError(ch.replica_id, ch.stage_id, msg)
        else:
            return
        gone = self._lingering.get(ch.replica_id)
        if gone is not None:    # the core drops it (moved off there), but should it keep its tensors: watched
            gone.readers[msg.request_id.split("/", 1)[0]] = None
        self._apply(self.core.handle(event))

    # ------------------------------------------------------------ actions out

    def _apply(self, actions: list[ev.Action]) -> None:
        failed: list[ev.Cancel] = []
        for a in actions:
            try:
                self._apply_handlers[type(a)](a)
            except Exception as e:
                rid = getattr(a, "request_id", None)
                if rid is None:
                    logger.warning("%s failed: %s: %s", type(a).__name__, type(e).__name__, e)
                    continue
                failed.append(ev.Cancel(rid, as_error(e)))
        for c in failed:    # the core ignores requests that already ended
            self._apply(self.core.handle(c))
        if self._lingering:
            self._close_unread()

    def _channel(self, r: ReplicaInfo) -> BaseChannel:
        ch = self._channels.get(r.replica_id)
        endpoint = r.endpoints.get("channel")
        local = r.endpoints.get("local", "") if self._local else ""
        if ch is not None and ch.endpoint in (endpoint, local) and not ch.closed:
            return ch
        if ch is not None:
            ch.close()
        self._lingering.pop(r.replica_id, None)     # the new channel is not the gone one's
        kw = dict(frontend_id=self.frontend_id, replica_id=r.replica_id, stage_id=r.stage_id, token=self.token,
                  on_message=self._on_stage_message, host=self.host)
        if local and same_host_name(local) is not None:
            # Connects on the loop; ZMQ takes over (`_on_local_fallback`) if the stage does not answer.
            zmq_kw = dict(kw, endpoint=endpoint)
            ch = LocalStageChannel.connect(
                lambda: StageChannel(self._ctx, **zmq_kw) if endpoint else None,
                self._on_local_fallback, endpoint=local, on_lost=self._on_channel_lost, **kw)
        elif endpoint:
            ch = StageChannel(self._ctx, endpoint=endpoint, **kw)
        else:
            raise Unavailable(f"stage {r.stage_id} replica {r.replica_id} has no channel endpoint")
        self._channels[r.replica_id] = ch
        ch.start()
        return ch

    def _do_send(self, a: ev.Send) -> None:
        try:
            self._channel(a.replica).post(a.message)
        except Unavailable as e:
            raise StageFailed(a.replica.stage_id, a.replica.replica_id, str(e), e.kind) from None

    def _live_channel(self, replica_id: str) -> BaseChannel | None:
        ch = self._channels.get(replica_id)
        return ch if ch is not None and not ch.closed else None   # gone: its arena went with it

    def _do_free(self, a: ev.Free) -> None:
        ch = self._live_channel(a.replica_id)
        if ch is None:
            return
        keys = self._fetch.hold(a.replica_id, a.transport, a.keys, ch, a.incarnation)   # a tensor being read: after it
        if keys:
            ch.post(m.FreeTensors(list(keys), a.transport, a.incarnation))

    def _do_abort(self, a: ev.AbortStage) -> None:
        ch = self._live_channel(a.replica_id)
        if ch is not None:
            ch.post(m.Abort(list(a.request_ids), a.keep_published))

    def _do_release(self, a: ev.ReleaseHold) -> None:
        ch = self._live_channel(a.replica_id)   # a hint: a gone replica's requests are replayed anyway
        if ch is not None:
            ch.post(m.Release(list(a.request_ids)))

    def _do_emit(self, a: ev.Emit) -> None:
        sink = self._sinks.get(a.request_id)
        if sink is None:
            return
        if a.tensor is None:
            sink.queue.put_nowait(a.output)
            return
        try:
            if on_loop(a.tensor):        # a small shared-memory memcpy: cheaper here than on a thread
                item = fill(self.consumer, a.output, a.tensor)
            else:                        # another host's or a large one: off the loop (omni/orchestrator/fetch.py)
                item = fut = asyncio.get_running_loop().create_future()
                self._fetch.read(self.consumer, a.output, a.tensor, a.producer,     # closed: Unavailable
                                 lambda result: self._fetched(a.request_id, sink, fut, a.tensor, a.producer, result))
        except Exception as e:
            sink.queue.put_nowait(as_error(e))   # in its place, also when it was the request's last output
            raise
        sink.queue.put_nowait(item)

    def _fetched(self, rid: str, sink: _Sink, fut: asyncio.Future, ref: TensorRef, producer: str,
                 result: PipelineOutput | BaseException) -> None:
        """A remote read ended (on the loop): its producer may free the tensor now, and the output
        (or the read's error, the request's) takes its place in the request's queue."""
        for ch in self._fetch.released(producer, ref):
            if not ch.closed:            # closed: that replica went (or restarted: its keys are others')
                ch.post(m.FreeTensors([ref.key], ref.transport, ref.incarnation))
        if self._lingering:
            self._close_unread()
        if fut.done():                   # the request's generator is gone (client left, timed out)
            return
        if self._sinks.get(rid) is not sink or (sink.outcome not in (None, "ok")
                                                and not isinstance(result, PipelineOutput)):
            # Gone, or it failed meanwhile (its Fail is queued behind: that error is the client's,
            # not the read's, which the stage's Abort made by freeing the tensor): nothing here.
            fut.cancel()
        elif isinstance(result, PipelineOutput):
            fut.set_result(result)
        else:
            err = Unavailable("frontend is shutting down") if isinstance(result, asyncio.CancelledError) \
                else as_error(result)
            fut.set_exception(err)
            self._apply(self.core.handle(ev.Cancel(rid, err)))

    def _do_fail(self, a: ev.Fail) -> None:
        sink = self._sinks.get(a.request_id)
        if sink is not None:
            sink.queue.put_nowait(a.error)

    def _do_finished(self, a: ev.Finished) -> None:
        sink = self._sinks.get(a.request_id)
        if sink is not None:
            sink.finished, sink.outcome = True, a.outcome

    # ------------------------------------------------------------ requests

    def needed_stages(self, req: PipelineRequest) -> list[int]:
        return self.core.needed_stages(req)

    async def generate(self, req: PipelineRequest) -> AsyncIterator[PipelineOutput]:
        """Stream the request's outputs; the last has finished=True. Closing the iterator
        before that aborts the request in every stage that holds it."""
        timeout = req.timeout_s or self.config.pipeline.request_timeout_s
        deadline = time.monotonic() + timeout
        sink = _Sink()
        self.gate.check()                     # a sleep with mode=wait under way: Unavailable
        check_inline(req)
        actions = self.core.submit(req)       # BadRequest / Unavailable: nothing was sent
        self._sinks[req.request_id] = sink
        try:
            self._apply(actions)
            while True:
                item = sink.queue.get_nowait() if not sink.queue.empty() else None
                if item is None or (isinstance(item, asyncio.Future) and not item.done()):
                    remaining = deadline - time.monotonic()
                    try:
                        if remaining <= 0:
                            raise TimeoutError from None
                        # Not wait_for: 3.11's returns an item that lands with a cancel and drops
                        # the cancel, and a client's disconnect then never stops the stream.
                        async with asyncio.timeout(remaining):
                            if item is None:
                                item = await sink.queue.get()
                            if isinstance(item, asyncio.Future):   # a remote read: its output, in its place
                                await asyncio.wait((item,))
                    except TimeoutError:
                        error = RequestTimeout(f"request {req.request_id} timed out after {timeout:g} s")
                        self._apply(self.core.handle(ev.Cancel(req.request_id, error)))
                        if sink.queue.empty() or isinstance(item, asyncio.Future):
                            raise error from None
                        continue
                if isinstance(item, asyncio.Future):
                    if item.cancelled():      # a read of a request that failed meanwhile: its error follows
                        continue
                    item = item.exception() or item.result()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not sink.finished:         # the client left (or a stop string ended it) first
                self._apply(self.core.handle(ev.Cancel(req.request_id)))
            self._sinks.pop(req.request_id, None)
            while not sink.queue.empty():     # reads still running: their outputs go nowhere
                left = sink.queue.get_nowait()
                if isinstance(left, asyncio.Future) and not left.cancel() and not left.cancelled():
                    left.exception()          # read: no "exception was never retrieved" at collection

    def end_text(self, request_id: str) -> None:
        """A stop string ended the request's text: its text stage ends there, its audio goes on."""
        self._apply(self.core.handle(ev.EndText(request_id)))

    # ------------------------------------------------------------ health and control

    def health(self) -> tuple[bool, str]:
        """Whether requests are served: every stage has a READY replica in the last topology known, also while
        the master is away (its restart): requests go on meanwhile. Not "ok" then says so, healthy or not."""
        if not self.topology.synced:
            return False, "no topology from the omni master yet"
        ready = self.topology.ready_stages()
        missing = [s.label for s in self.config.stages if s.stage_id not in ready]
        away = "" if self.topology.connected else "omni master unreachable: serving from the last topology it sent"
        if missing:
            return False, "no READY replica for " + ", ".join(missing) + (f" ({away})" if away else "")
        return True, away or "ok"

    async def sleep(self, level: int = 1, mode: str = "abort", stage_ids: tuple[int, ...] = ()) -> dict:
        """vLLM's modes: `abort` ends the requests in flight (503) and sleeps; `wait` lets them finish first
        (omni/orchestrator/quiesce.py); `frontends`: their acks of the wait (one not ok: nothing slept)."""
        quiesce.check_stage_ids(stage_ids, [s.stage_id for s in self.config.stages])
        if mode != "wait":
            return await self._command("SLEEP", {"level": level, "mode": mode}, stage_ids)
        wait_s = quiesce.wait_s_for(self.config.pipeline.request_timeout_s)
        quiet, results = await self._master_call(lambda m: quiesce.sleep_when_idle(m, level, wait_s, stage_ids))
        frontends = [{"replica_id": r.replica_id, "ok": r.ok, "message": r.message, "outcome": r.outcome}
                     for r in quiet]
        if results is None:   # a frontend still busy: nothing slept (api/control.py answers 409)
            return {"results": [], "frontends": frontends, "is_sleeping": await self.is_sleeping()}
        return {**await self._outcome(results), "frontends": frontends}

    async def wake_up(self, stage_ids: tuple[int, ...] = ()) -> dict:
        quiesce.check_stage_ids(stage_ids, [s.stage_id for s in self.config.stages])
        try:
            return await self._command("WAKE_UP", {}, stage_ids)
        except ConfigError as e:   # the master's FAILED_PRECONDITION: a sleep with mode=wait under way
            raise Conflict(str(e)) from None   # (master/targets.WaitHolds: the sleep would undo the wakeup)

    async def _command(self, kind: str, args: dict, stage_ids: tuple[int, ...] = ()) -> dict:
        return await self._outcome(await self._master_call(
            lambda m: m.send_command(kind, stage_ids, args, timeout_s=60.0)))

    async def _master_call(self, call: Callable[[Any], Any]):
        if self.master is None:
            raise Unavailable("no omni master connection: cannot reach the stage engines")
        try:
            return await call(self.master)
        except OmniError:
            raise
        except Exception as e:
            raise Unavailable(f"omni master unreachable: {e}") from None

    async def _outcome(self, results) -> dict:
        out = {"results": [
            {"stage_id": r.stage_id, "replica_id": r.replica_id, "ok": r.ok, "message": r.message}
            for r in results
        ]}
        out["is_sleeping"] = await self.is_sleeping()
        return out

    async def is_sleeping(self) -> bool:
        if self.master is None:
            raise Unavailable("no omni master connection: sleep state unknown")
        try:
            status = await self.master.get_status()
        except OmniError:
            raise
        except Exception as e:
            raise Unavailable(f"omni master unreachable: {e}") from None
        stages = [r for r in status.replicas if r.role == "STAGE" and r.state in ("READY", "DRAINING")]
        capable = [r for r in stages if r.capabilities.get("can_sleep") == "true"]
        return bool(capable) and all(r.is_sleeping for r in capable)

    def metrics_text(self) -> str:
        # The same `frontend` label as the HTTP metrics (the index), not the channel id "fe0-PID".
        label = self.metrics_label or self.frontend_id
        kinds = {"local": 0, "zmq": 0}
        for ch in self._channels.values():
            kinds[ch.kind] += not ch.closed
        return self.metrics.render(label) + "".join(
            ["# HELP omni_stage_channels Open channels to stage replicas, by carrier (local: same host).\n",
             "# TYPE omni_stage_channels gauge\n"]
            + [f"omni_stage_channels{labels({'frontend': label, 'kind': k})} {n}\n" for k, n in kinds.items()]
            + ["# HELP omni_master_connected 1 while this frontend's topology watch is connected to the omni master.\n",
               "# TYPE omni_master_connected gauge\n",
               f"omni_master_connected{labels({'frontend': label})} {int(self.topology.connected)}\n"])

    def deployment_metrics_text(self) -> str:
        """What the stages report of themselves (not per frontend): the answering frontend adds it."""
        return render_engine_steps(self.topology.replicas.values())

    @property
    def in_flight(self) -> int:
        return len(self.core.requests)

    async def close(self) -> None:
        for rid in list(self.core.requests):
            self._apply(self.core.handle(ev.Cancel(rid, Unavailable("frontend is shutting down"))))
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        self._fetch.close()
        self._ctx.term()
