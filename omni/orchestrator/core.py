"""Orchestrator: one per frontend process.

Per request it picks a replica per needed stage (least loaded, sticky), sends the
entry stage its input, and as outputs stream back on each replica's channel it
runs the stage processors and forwards inputs (tensor descriptors only) to the
next stage, yielding the final outputs the client asked for.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np
import zmq.asyncio

from omni import processors as procs
from omni.config import DeployConfig, StageConfig
from omni.errors import BadRequest, OmniError, RequestTimeout, StageFailed, Unavailable
from omni.master.types import ReplicaInfo
from omni.orchestrator.channel import StageChannel
from omni.orchestrator.metrics import OrchestratorMetrics
from omni.orchestrator.topology import GONE, Topology
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from omni.stage import messages as m

logger = logging.getLogger(__name__)


def load_processor(path: str | None) -> Callable:
    if not path:
        return procs.passthrough
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OmniError(f"processor {path!r} cannot be loaded: {e}") from None


@dataclass
class _StageState:
    replica: ReplicaInfo | None = None
    open: set[str] = field(default_factory=set)        # engine request ids in flight
    inputs_closed: bool = False
    started: bool = False                              # something was sent
    pending: procs.StageInput | None = None            # held back to mark the last piece final
    refs_in: dict[str, list] = field(default_factory=dict)   # erid -> refs sent to this stage
    proc_state: dict = field(default_factory=dict)
    sub_order: list[str] = field(default_factory=list)
    sub_buffer: dict[str, list] = field(default_factory=dict)
    first_output_at: float | None = None
    n_sub: int = 0
    streamed: bool = False                             # pieces went out at once; close with an empty final
    # Inputs sent per engine request id, kept until it finishes, so a replica that dies before
    # any output can be replaced by sending them again (descriptors only; producers keep the bytes).
    sent: dict[str, list] = field(default_factory=dict)
    sending: int = 0                                   # _send_soon tasks not finished yet


class _Request:
    def __init__(self, req: PipelineRequest, needed: list[int], extra: dict):
        self.req = req
        self.rid = req.request_id
        self.needed = needed
        self.stages = {s: _StageState() for s in needed}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_extra = extra
        self.done = False
        self.started_at = time.monotonic()
        self.first_output_at: float | None = None
        self.finish_reason: str | None = None
        self.num_prompt_tokens: int | None = None


class _Ctx:
    def __init__(self, detokenize: Callable[[list[int]], str], extra: dict):
        self.detokenize = detokenize
        self.request_extra = extra


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
        self.topology = topology
        self.detokenize = detokenize
        self.consumer = consumer
        self.token = token
        self.host = host
        self.master = master
        if choose_transport is None:
            from omni.transport.factory import choose_transport
        self._choose_transport = choose_transport
        self._processors = {s.stage_id: load_processor(s.processor) for s in config.stages}
        self._ctx = zmq.asyncio.Context()
        self._channels: dict[str, StageChannel] = {}
        self._requests: dict[str, _Request] = {}
        self._by_replica: dict[str, set[str]] = {}       # replica id -> request ids holding work there
        self._ids = itertools.count()
        self.metrics = OrchestratorMetrics()
        topology.on_change(self._on_topology)

    # ------------------------------------------------------------ topology / channels

    def _on_topology(self, r: ReplicaInfo, kind: str) -> None:
        if r.role != "STAGE":
            return
        if kind == "REMOVED" or r.state in GONE:
            ch = self._channels.pop(r.replica_id, None)
            if ch is not None:
                ch.close()
            for rid in list(self._by_replica.pop(r.replica_id, ())):
                req = self._requests.get(rid)
                picked = [st for st in req.stages.values()
                          if st.replica is not None and st.replica.replica_id == r.replica_id] if req else []
                if picked and not any(st.started for st in picked):
                    for st in picked:   # nothing sent there yet: pick another replica at the first send
                        st.replica = None
                    continue
                if req is not None and self._replay(req, r):
                    continue
                if req is not None:
                    self._fail(req, StageFailed(r.stage_id, r.replica_id, f"replica is {r.state.lower() if kind != 'REMOVED' else 'gone'}"))

    def _replay(self, state: _Request, dead: ReplicaInfo) -> bool:
        """Move a stage's part of the request to another replica when the dead one had produced
        nothing for it yet and every input was already sent: nothing of it was seen, so sending
        the same inputs again (in order) is safe. Shared-memory inputs need a replica on the
        dead one's host; a stage still receiving inputs is not moved (their order would mix)."""
        held = [s for s, st in state.stages.items()
                if st.replica is not None and st.replica.replica_id == dead.replica_id]
        if len(held) != 1 or state.done:
            return False
        s = held[0]
        st = state.stages[s]
        if st.first_output_at is not None or not st.inputs_closed or st.pending is not None or st.sending \
                or not st.sent:
            return False
        others = [r for r in self.topology.stage_replicas(s) if r.replica_id != dead.replica_id]
        if any(ref.transport == "shm" for items in st.sent.values() for inp, _ in items
               for ref in inp.tensors.values()):
            others = [r for r in others if r.host == dead.host]
        if not others:
            return False
        st.replica, st.started = min(others, key=self._load), False
        sent, st.sent = st.sent, {}
        for erid in sent:
            st.refs_in.pop(erid, None)     # recorded again as they are sent again
        logger.info("request %s: %s replica %s is gone before any output; replaying on %s",
                    state.rid, self.config.stage(s).label, dead.replica_id, st.replica.replica_id)
        self.metrics.replayed(s)

        async def resend() -> None:
            for erid, items in sent.items():
                for inp, final in items:
                    await self._send_input(state, s, erid, inp, final)
        self._spawn(resend(), state)
        return True

    async def _channel(self, r: ReplicaInfo) -> StageChannel:
        ch = self._channels.get(r.replica_id)
        if ch is not None and ch.endpoint == r.endpoints.get("channel"):
            return ch
        if ch is not None:
            ch.close()
        endpoint = r.endpoints.get("channel")
        if not endpoint:
            raise Unavailable(f"stage {r.stage_id} replica {r.replica_id} has no channel endpoint")
        ch = StageChannel(self._ctx, frontend_id=self.frontend_id, replica_id=r.replica_id,
                          stage_id=r.stage_id, endpoint=endpoint, token=self.token,
                          on_message=self._on_stage_message, host=self.host)
        self._channels[r.replica_id] = ch
        await ch.start()
        return ch

    def _pick(self, stage_id: int) -> ReplicaInfo:
        replicas = self.topology.stage_replicas(stage_id)
        if not replicas:
            stage = self.config.stage(stage_id)
            raise Unavailable(f"{stage.label} has no READY replica")
        return min(replicas, key=self._load)

    def _load(self, r: ReplicaInfo) -> tuple[int, str]:
        """Least loaded first: the master's load report plus what this frontend sent since."""
        return (r.queue_len + r.in_flight + len(self._by_replica.get(r.replica_id, ())), r.replica_id)

    def health(self) -> tuple[bool, str]:
        if not self.topology.synced:
            return False, "no topology from the omni master yet"
        ready = self.topology.ready_stages()
        missing = [s.label for s in self.config.stages if s.stage_id not in ready]
        if missing:
            return False, "no READY replica for " + ", ".join(missing)
        return True, "ok"

    # ------------------------------------------------------------ requests

    def needed_stages(self, req: PipelineRequest) -> list[int]:
        finals = []
        for modality in req.modalities:
            stage = self.config.final_stage(modality)
            if stage is None:
                raise BadRequest(
                    f"modality {modality!r} is not produced by this pipeline "
                    f"(it produces {self.config.modalities()})"
                )
            finals.append(stage.stage_id)
        needed: set[int] = set()
        todo = list(finals)
        while todo:
            s = todo.pop()
            if s in needed or s < req.entry_stage:
                continue
            needed.add(s)
            todo.extend(self.config.stage(s).upstream())
        if req.entry_stage not in needed:
            raise BadRequest(f"modalities {list(req.modalities)} are not reachable from stage {req.entry_stage}")
        return sorted(needed)

    async def generate(self, req: PipelineRequest) -> AsyncIterator[PipelineOutput]:
        needed = self.needed_stages(req)
        if req.request_id in self._requests:
            raise BadRequest(f"request id {req.request_id!r} is already in flight")
        state = _Request(req, needed, dict(req.extra))
        for s in needed:
            state.stages[s].replica = self._pick(s)
        # Counted as load at once: concurrent requests spread over downstream replicas
        # too, not only over the entry stage's (whose input is sent right away).
        for st in state.stages.values():
            self._by_replica.setdefault(st.replica.replica_id, set()).add(req.request_id)
        self._requests[req.request_id] = state
        self.metrics.request_started()
        timeout = req.timeout_s or self.config.pipeline.request_timeout_s
        deadline = state.started_at + timeout
        ok = False
        try:
            entry = self.config.stage(req.entry_stage)
            first = procs.StageInput(token_ids=req.prompt_token_ids, text=req.text,
                                     extra=dict(req.extra))
            await self._send_input(state, entry.stage_id, state.rid, first, final=True)
            state.stages[entry.stage_id].inputs_closed = True
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeout(f"request {req.request_id} timed out after {timeout:.0f} s")
                try:
                    item = await asyncio.wait_for(state.queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"request {req.request_id} timed out after {timeout:.0f} s") from None
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    ok = True
                    return
        finally:
            self._finish(state, aborted=not ok)
            self.metrics.request_finished(ok, time.monotonic() - state.started_at)

    async def _send_input(self, state: _Request, stage_id: int, erid: str,
                          inp: procs.StageInput, final: bool) -> None:
        st = state.stages[stage_id]
        stage = self.config.stage(stage_id)
        replica = st.replica
        if replica is None or replica.replica_id not in self.topology.replicas or \
                self.topology.replicas[replica.replica_id].state != "READY":
            if st.started:
                raise StageFailed(stage_id, replica.replica_id if replica else "?", "replica is gone")
            replica = st.replica = self._pick(stage_id)
        ch = await self._channel(replica)
        # Stage defaults (e.g. the talker's noise scales) under the request's own options.
        extra = {**stage.default_sampling_params, **inp.extra}
        producer = extra.pop("_producer", "")
        extra.setdefault("final", final)
        out_transport, out_tensors = self._out_route(state, stage)
        msg = m.AddRequest(
            request_id=erid,
            prompt_token_ids=inp.token_ids,
            text=inp.text,
            sampling=state.req.sampling,
            tensors=dict(inp.tensors),
            extra=extra,
            out_transport=out_transport,
            out_tensors=out_tensors,
            sent_at=time.time(),
        )
        st.started = True
        st.open.add(erid)
        st.sent.setdefault(erid, []).append((inp, final))
        if inp.tensors:
            st.refs_in.setdefault(erid, []).extend((producer, r) for r in inp.tensors.values())
        self._by_replica.setdefault(replica.replica_id, set()).add(state.rid)
        await ch.send(msg)

    def _out_route(self, state: _Request, stage: StageConfig) -> tuple[str, bool]:
        """Where this stage's output tensors go for this request, and if anyone reads them."""
        me = state.stages[stage.stage_id].replica
        my_host = me.host if me else self.host
        for t in self.config.downstream(stage.stage_id):
            if t in state.stages:
                consumer = state.stages[t].replica
                conn = stage.connectors.get(str(t))
                configured = conn.transport if conn and conn.transport != "auto" else None
                return self._choose_transport(my_host, consumer.host if consumer else my_host,
                                              configured), True
        if stage.final_output and stage.final_output_type in ("audio", "embedding"):
            return self._choose_transport(my_host, self.host, None), True
        return "", False

    # ------------------------------------------------------------ stage messages

    def _on_stage_message(self, ch: StageChannel, msg: Any) -> None:
        rid = msg.request_id.split("/", 1)[0]
        state = self._requests.get(rid)
        if state is None or state.done:
            # Late output of an aborted request: free what it published.
            if isinstance(msg, m.Output):
                self._free_refs(ch, list(msg.tensors.values()))
            return
        try:
            if isinstance(msg, m.RequestError):
                raise StageFailed(ch.stage_id, ch.replica_id, msg.message)
            self._on_output(state, ch, msg)
        except OmniError as e:
            self._fail(state, e)
        except Exception as e:
            logger.exception("request %s: orchestration failed", rid)
            self._fail(state, OmniError(f"orchestration failed: {type(e).__name__}: {e}"))

    def _on_output(self, state: _Request, ch: StageChannel, out: m.Output) -> None:
        s = ch.stage_id
        st = state.stages.get(s)
        if st is None:
            self._free_refs(ch, list(out.tensors.values()))
            return
        now = time.monotonic()
        if out.queue_s is not None:
            self.metrics.stage_queue(s, out.queue_s)
        if out.sent_at:
            self.metrics.output_queue(s, max(0.0, time.time() - out.sent_at))
        if st.first_output_at is None:
            st.first_output_at = now
            self.metrics.stage_first_output(s, now - state.started_at)
        self.metrics.stage_step(s, out.step_s)
        if out.num_prompt_tokens is not None and state.num_prompt_tokens is None:
            state.num_prompt_tokens = out.num_prompt_tokens
        # Sub-requests of one stage are forwarded in the order they were made.
        if out.request_id in st.sub_order:
            if out.request_id != st.sub_order[0]:
                st.sub_buffer.setdefault(out.request_id, []).append(out)
                return
            self._process(state, ch, s, out)
            if out.finished:
                st.sub_order.pop(0)
                self._drain_subs(state, ch, s)
            return
        self._process(state, ch, s, out)

    def _drain_subs(self, state: _Request, ch: StageChannel, s: int) -> None:
        st = state.stages[s]
        while st.sub_order:
            buffered = st.sub_buffer.pop(st.sub_order[0], [])
            for b in buffered:
                self._process(state, ch, s, b)
            if not (buffered and buffered[-1].finished):
                return
            st.sub_order.pop(0)

    def _process(self, state: _Request, ch: StageChannel, s: int, out: m.Output) -> None:
        st = state.stages[s]
        stage = self.config.stage(s)
        forwarded: set[int] = set()
        if stage.final_output and stage.final_output_type in state.req.modalities:
            self._emit_final(state, ch, stage, out)
        for t in self.config.downstream(s):
            if t not in state.stages:
                continue
            ctx = _Ctx(self.detokenize, state.request_extra)
            for inp in self._processors[t](ctx, state.stages[t].proc_state, out):
                forwarded.update(id(r) for r in inp.tensors.values())
                self._route(state, t, inp, ch.replica_id)
        unused = [r for r in out.tensors.values() if id(r) not in forwarded]
        if unused and not (stage.final_output and stage.final_output_type in ("audio", "embedding")):
            self._free_refs(ch, unused)
        if out.finished:
            st.open.discard(out.request_id)
            st.sent.pop(out.request_id, None)
            self._release_inputs(state, s, out.request_id)
            if out.finish_reason and stage.final_output_type == "text":
                state.finish_reason = out.finish_reason
            self._check_done(state, s)

    def _emit_final(self, state: _Request, ch: StageChannel, stage: StageConfig, out: m.Output) -> None:
        if state.first_output_at is None:
            state.first_output_at = time.monotonic()
            self.metrics.first_output(state.first_output_at - state.started_at)
        kind = stage.final_output_type
        po = PipelineOutput(request_id=state.rid, stage_id=stage.stage_id, modality=kind,
                            num_prompt_tokens=state.num_prompt_tokens)
        if kind == "text":
            if not out.token_ids:
                return
            po.token_ids = list(out.token_ids)
        else:
            name, ref = next(iter(out.tensors.items()), (None, None))
            if ref is None:
                return
            tensor = self.consumer.get(ref).float()
            self.metrics.tensor_bytes(ref.nbytes, ref.transport)
            if kind == "audio":
                po.audio_pcm = tensor.numpy().astype(np.float32).tobytes()
                po.sample_rate = int(state.request_extra.get("sample_rate", 0) or 22050)
            else:
                po.embedding = tensor.flatten().tolist()
            self._free_refs(ch, [ref])
        state.queue.put_nowait(po)

    def _route(self, state: _Request, t: int, inp: procs.StageInput, producer: str) -> None:
        st = state.stages[t]
        for ref in inp.tensors.values():
            self.metrics.tensor_bytes(ref.nbytes, ref.transport)
        inp.extra["_producer"] = producer
        if inp.sub_id is not None:
            erid = f"{state.rid}/{inp.sub_id}"
            st.sub_order.append(erid)
            self._send_soon(state, t, erid, inp, final=True)
            return
        if inp.stream:
            st.streamed = True
            self._send_soon(state, t, state.rid, inp, final=False)
            return
        if st.pending is not None:
            prev, st.pending = st.pending, inp
            self._send_soon(state, t, state.rid, prev, final=False)
        else:
            st.pending = inp

    def _send_soon(self, state: _Request, t: int, erid: str, inp: procs.StageInput, final: bool) -> None:
        # Open now, not when the task runs, so completion checks see it at once.
        st = state.stages[t]
        st.open.add(erid)
        st.sending += 1

        async def send() -> None:
            try:
                await self._send_input(state, t, erid, inp, final)
            finally:
                st.sending -= 1
        self._spawn(send(), state)

    def _spawn(self, coro, state: _Request) -> None:
        task = asyncio.get_running_loop().create_task(coro)

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                self._fail(state, exc if isinstance(exc, OmniError) else OmniError(str(exc)))
        task.add_done_callback(done)

    def _stage_done(self, state: _Request, s: int) -> bool:
        st = state.stages[s]
        return st.inputs_closed and not st.open and st.pending is None

    def _check_done(self, state: _Request, s: int) -> None:
        """Cascade: a stage whose inputs are closed and that holds nothing is done."""
        if not self._stage_done(state, s):
            return
        for t in self.config.downstream(s):
            ts = state.stages.get(t)
            if ts is None or ts.inputs_closed:
                continue
            if all(self._stage_done(state, u) for u in self.config.stage(t).upstream() if u in state.stages):
                ts.inputs_closed = True
                if ts.pending is not None:
                    inp, ts.pending = ts.pending, None
                    self._send_soon(state, t, state.rid, inp, final=True)
                elif ts.streamed:
                    self._send_soon(state, t, state.rid, procs.StageInput(), final=True)
                self._check_done(state, t)
        if not state.done and all(self._stage_done(state, x) for x in state.stages):
            state.done = True
            state.queue.put_nowait(PipelineOutput(
                request_id=state.rid, stage_id=s, modality="text", finished=True,
                finish_reason=state.finish_reason or "stop",
                num_prompt_tokens=state.num_prompt_tokens))

    # ------------------------------------------------------------ cleanup

    def _release_inputs(self, state: _Request, s: int, erid: str) -> None:
        """The stage finished with these tensors: their producers may free them."""
        by_producer: dict[str, list] = {}
        for producer, ref in state.stages[s].refs_in.pop(erid, []):
            by_producer.setdefault(producer, []).append(ref)
        for producer, refs in by_producer.items():
            ch = self._channels.get(producer)
            if ch is not None:
                self._free_refs(ch, refs)
            # else: the producer is gone, and its arena with it.

    def _free_refs(self, ch: StageChannel, refs: list) -> None:
        by_transport: dict[str, list[int]] = {}
        for ref in refs:
            by_transport.setdefault(ref.transport, []).append(ref.key)
        for transport, keys in by_transport.items():
            if not ch.closed:
                self._spawn_quiet(ch.send(m.FreeTensors(keys, transport)))

    def _spawn_quiet(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _fail(self, state: _Request, exc: BaseException) -> None:
        if not state.done:
            state.queue.put_nowait(exc)

    def _finish(self, state: _Request, aborted: bool) -> None:
        state.done = True
        self._requests.pop(state.rid, None)
        for s, st in state.stages.items():
            replica = st.replica
            if replica is None:
                continue
            holders = self._by_replica.get(replica.replica_id)
            if holders is not None:
                holders.discard(state.rid)
            ch = self._channels.get(replica.replica_id)
            if ch is None or ch.closed:
                continue
            if aborted and st.started:
                ids = sorted(st.open | set(st.sub_order) | {state.rid})
                self._spawn_quiet(ch.send(m.Abort(ids)))
            for erid in list(st.refs_in):
                self._release_inputs(state, s, erid)

    # ------------------------------------------------------------ control

    async def sleep(self, level: int = 1) -> dict:
        return await self._command("SLEEP", {"level": level})

    async def wake_up(self) -> dict:
        return await self._command("WAKE_UP", {})

    async def _command(self, kind: str, args: dict) -> dict:
        if self.master is None:
            raise Unavailable("no omni master connection: cannot reach the stage engines")
        try:
            results = await self.master.send_command(kind, (), args, timeout_s=60.0)
        except OmniError:
            raise
        except Exception as e:
            raise Unavailable(f"omni master unreachable: {e}") from None
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
        return self.metrics.render(self.frontend_id)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def close(self) -> None:
        for rid, state in list(self._requests.items()):
            self._fail(state, Unavailable("frontend is shutting down"))
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        self._ctx.term()
