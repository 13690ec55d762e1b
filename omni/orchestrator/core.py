"""The orchestrator core: each request's stage graph, as events in and actions out.

No sockets, tasks or clocks it waits on: `submit(request)` and `handle(event)` return the
actions (omni/orchestrator/events.py) the Orchestrator carries out in order. Per request:
the stages it needs (ancestors of the stages making the requested modalities), a sticky
least-loaded, awake-first replica per stage (picking.py), the entry stage's input, then for each output: final
outputs to the client, the next stages' processors turning it into inputs, and a stage is
done when its inputs are closed and it holds nothing; the request is done when every
needed stage is.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from omni import errors
from omni import processors as procs
from omni.config import DeployConfig, StageConfig
from omni.errors import BadRequest, OmniError, StageFailed
from omni.master.types import ReplicaInfo
from omni.orchestrator import events as ev
from omni.orchestrator import picking
from omni.orchestrator.limits import RecentFailures
from omni.orchestrator.metrics import OrchestratorMetrics
from omni.orchestrator.replay import move, replay_plan
from omni.orchestrator.request_state import (ProcessorContext, RequestState, cut_part, finals_below, free_actions,
                                             input_host, load_processor, needed_stages, out_route, ref_id, to_client)
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from omni.sampling import SamplingOverrides
from omni.stage import messages as m
from omni.transport.base import TensorRef

logger = logging.getLogger(__name__)

class OrchestratorCore:
    def __init__(self, config: DeployConfig, *, topology: Topology, detokenize: Callable[[list[int]], str],
                 host: str = "127.0.0.1", choose_transport: Callable[[str, str, str | None], str] | None = None,
                 metrics: OrchestratorMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.topology = topology
        self.detokenize = detokenize
        self.host = host
        if choose_transport is None:
            from omni.transport.factory import choose_transport
        self._choose_transport = choose_transport
        self.metrics = metrics if metrics is not None else OrchestratorMetrics()
        self.clock = clock
        self._processors = {s.stage_id: load_processor(s.processor) for s in config.stages}
        self._overrides = {s.stage_id: SamplingOverrides() if "prompt" in s.inputs else s.default_sampling_params
                           for s in config.stages}
        # Stage with first_output_hold_ms -> the final-output stages it feeds (whose first output releases it).
        self._hold_for = {s.stage_id: finals_below(config, s.stage_id) for s in config.stages
                          if s.first_output_hold_ms}
        self.requests: dict[str, RequestState] = {}
        self.by_replica: dict[str, set[str]] = {}       # replica id -> request ids holding work there
        self.failures = RecentFailures()
        self._out: list[ev.Action] = []
        self._handlers = {ev.StageOutput: self._on_output, ev.StageError: self._on_error,
                          ev.ReplicaGone: self._on_gone, ev.Cancel: self._on_cancel, ev.EndText: self._on_end_text}

    # ------------------------------------------------------------ entry points

    def submit(self, req: PipelineRequest) -> list[ev.Action]:
        """Admit a request and send the entry stage its input. Raises BadRequest/Unavailable
        (nothing was sent then)."""
        needed = self.needed_stages(req)
        extra = req.stage_overrides and sorted(
            set(req.stage_overrides) - {s.stage_id for s in self.config.stages if s.stage_id != req.entry_stage})
        if extra:
            raise BadRequest(f"sampling_params_list: entry {extra[0]} names no later stage of this pipeline "
                             f"(stages 0..{len(self.config.stages) - 1}, {req.entry_stage} takes the request's own)")
        if req.request_id in self.requests:
            raise BadRequest(f"request id {req.request_id!r} is already in flight")
        state = RequestState(req, needed, self.clock())
        for st_id, st in state.stages.items():
            st.replica = self.pick(st_id, req)
        # Counted as load at once: concurrent requests spread over downstream replicas
        # too, not only over the entry stage's (whose input is sent right away).
        for st in state.stages.values():
            self.by_replica.setdefault(st.replica.replica_id, set()).add(state.rid)
        self.requests[state.rid] = state
        self.metrics.request_started()
        self._out = []
        first = self.entry_input(req)
        self._guarded(state, lambda: self._send(state, req.entry_stage, state.rid, first, final=True))
        state.stages[req.entry_stage].inputs_closed = True
        return self._take()

    @staticmethod
    def entry_input(req: PipelineRequest) -> procs.StageInput:
        """What the entry stage gets: the prompt's token ids or text (the place for new request inputs)."""
        return procs.StageInput(token_ids=req.prompt_token_ids, text=req.text, voice=req.voice, speed=req.speed,
                                audio_out=req.audio_out,
                                inline=dict(req.inputs), image=req.image)

    def handle(self, event: ev.Event) -> list[ev.Action]:
        self._out = []
        self._handlers[type(event)](event)
        return self._take()

    def _take(self) -> list[ev.Action]:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ replicas

    def needed_stages(self, req: PipelineRequest) -> list[int]:
        return needed_stages(self.config, req)

    def pick(self, stage_id: int, req: PipelineRequest | None = None, host: str | None = None,
             ran_on: frozenset | set = frozenset()) -> ReplicaInfo:
        return picking.pick(self.config.stage(stage_id), self.topology.stage_replicas(stage_id), req, host,
                            self.load, ran_on)

    def load(self, r: ReplicaInfo) -> tuple[int, str]:
        """Least loaded first: the master's load report plus what this frontend sent since,
        plus the requests that replica failed lately."""
        return (r.queue_len + r.in_flight + len(self.by_replica.get(r.replica_id, ()))
                + self.failures.count(r.replica_id, self.clock()), r.replica_id)

    # ------------------------------------------------------------ events

    def _guarded(self, state: RequestState, fn: Callable[[], None]) -> None:
        try:
            fn()
        except OmniError as e:
            self._fail(state, e)
        except Exception as e:
            logger.exception("request %s: orchestration failed", state.rid)
            self._fail(state, OmniError(f"orchestration failed: {type(e).__name__}: {e}"))

    def _on_output(self, e: ev.StageOutput) -> None:
        out = e.output
        state = self.requests.get(out.request_id.split("/", 1)[0])
        st = state.stages.get(e.stage_id) if state is not None else None
        if (st is None or st.replica is None or st.replica.replica_id != e.replica_id
                or out.request_id in st.ended):
            # Late output of a request that ended, of a stage it does not use, from a replica it
            # was moved away from (replayed), or of a stage aborted as unneeded: free what it published.
            self._free(e.replica_id, list(out.tensors.values()))
            return
        for ref in out.tensors.values():
            state.origin[ref_id(ref)] = e.replica_id
        self._guarded(state, lambda: self._output(state, e.stage_id, out))

    def _on_error(self, e: ev.StageError) -> None:
        if e.error.kind != errors.CLIENT:   # the replica's fault, not the request's
            self.failures.add(e.replica_id, self.clock())
        state = self.requests.get(e.error.request_id.split("/", 1)[0])
        st = state.stages.get(e.stage_id) if state is not None else None
        if (st is not None and st.replica is not None and st.replica.replica_id == e.replica_id
                and e.error.request_id not in st.ended):    # not of a stage done with it, or aborted as unneeded
            # Refused as unavailable (draining or asleep since it was picked) before any output: moved.
            if e.error.kind != errors.UNAVAILABLE or not self._replay(state, st.replica, [e.stage_id],
                                                                      e.error.message, refused=True):
                entry = state.rid if e.stage_id == state.req.entry_stage else None
                self._fail(state, StageFailed(e.stage_id, e.replica_id, e.error.message, e.error.kind, entry_rid=entry))

    def _on_cancel(self, e: ev.Cancel) -> None:
        state = self.requests.get(e.request_id)
        if state is None:
            return
        if e.error is None:
            self._end(state, "aborted")
        else:
            self._fail(state, e.error)

    def _on_end_text(self, e: ev.EndText) -> None:
        """Its text stage is cut where it is and closed as if it had finished there: the stages after it
        speak what they were sent (and what their processors held) and the request ends with them."""
        state = self.requests.get(e.request_id)
        s = next((t for t in (state.stages if state else ()) if self.config.stage(t).final_output
                  and self.config.stage(t).final_output_type == "text"), None)
        if s is None or state.rid in state.stages[s].ended or self._stage_done(state, s):
            return
        self._out += cut_part(state, s, keep_published=True)    # the talker still reads its hidden states
        self._guarded(state, lambda: self._process(state, s, m.Output(request_id=state.rid, finished=True)))

    def _on_gone(self, e: ev.ReplicaGone) -> None:
        dead = e.replica
        for rid in sorted(self.by_replica.pop(dead.replica_id, ())):
            state = self.requests.get(rid)
            if state is None:
                continue
            # A stage done with the request, or that ended its stream early, needs its replica no more.
            held = [s for s, st in state.stages.items() if st.replica is not None
                    and st.replica.replica_id == dead.replica_id and not self._stage_done(state, s)
                    and not (state.rid in st.ended and not st.open)]
            if not held:
                continue
            if not any(state.stages[s].started for s in held):
                for s in held:    # nothing sent there yet: pick another replica at the first send
                    state.stages[s].replica = None
                continue
            if not self._replay(state, dead, held, f"replica is {e.why}"):
                self._fail(state, StageFailed(dead.stage_id, dead.replica_id, f"replica is {e.why}",
                                              errors.UNAVAILABLE))

    def _replay(self, state: RequestState, dead: ReplicaInfo, held: list[int], reason: str,
                refused: bool = False) -> bool:
        """Move one stage's part of the request off `dead` (omni/orchestrator/replay.py); True: moved,
        or failed with why it could not (its inputs' producer is gone too, no replica left to try)."""
        target = (replay_plan(state, held[0], dead, self.topology, self.load, reason, refused)
                  if len(held) == 1 else None)
        if not isinstance(target, ReplicaInfo):
            if target is not None:
                self._fail(state, target)
            return target is not None
        s, st = held[0], state.stages[held[0]]
        # A SUSPECT replica may still be alive: what it holds of the request is dropped there.
        self._out.append(ev.AbortStage(dead.replica_id, tuple(sorted(st.open | set(st.sub_order) | {state.rid}))))
        self._unhold(dead.replica_id, state.rid)
        sent = move(st, dead, target, refused)
        logger.info("request %s: %s replica %s: %s before any output; replaying on %s",
                    state.rid, self.config.stage(s).label, dead.replica_id, reason, target.replica_id)
        self.metrics.replayed(s)
        for erid, items in sent.items():
            for inp, final in items:
                self._send(state, s, erid, inp, final)
        return True

    # ------------------------------------------------------------ outputs

    def _output(self, state: RequestState, s: int, out: m.Output) -> None:
        st = state.stages[s]
        now = self.clock()
        if out.queue_s is not None:
            self.metrics.stage_queue(s, out.queue_s)
        if out.sent_at:
            self.metrics.output_queue(s, max(0.0, time.time() - out.sent_at))
        if st.first_output_at is None:
            st.first_output_at = now
            self.metrics.stage_first_output(s, now - state.started_at)
            if self.config.stage(s).final_output:
                self._release_holds(state, s)
        self.metrics.stage_step(s, out.step_s)
        if out.num_prompt_tokens is not None and state.num_prompt_tokens is None:
            state.num_prompt_tokens = out.num_prompt_tokens
        # Sub-requests of one stage are forwarded in the order they were made.
        if out.request_id in st.sub_order:
            if out.request_id != st.sub_order[0]:
                st.sub_buffer.setdefault(out.request_id, []).append(out)
                return
            self._process(state, s, out)
            if out.finished:
                st.sub_order.pop(0)
                self._drain_subs(state, s)
            return
        self._process(state, s, out)

    def _drain_subs(self, state: RequestState, s: int) -> None:
        st = state.stages[s]
        while st.sub_order and state.rid in self.requests:
            buffered = st.sub_buffer.pop(st.sub_order[0], [])
            for b in buffered:
                self._process(state, s, b)
            if not (buffered and buffered[-1].finished):
                return
            st.sub_order.pop(0)

    def _process(self, state: RequestState, s: int, out: m.Output) -> None:
        st = state.stages[s]
        stage = self.config.stage(s)
        forwarded: set[tuple] = set()
        if to_client(stage, state.req):
            self._emit_final(state, stage, out)
        for t in self.config.downstream(s):
            if t not in state.stages:
                continue
            ctx = ProcessorContext(self.detokenize, state.req)
            for inp in self._processors[t](ctx, state.stages[t].proc_state, out):
                if self._route(state, t, inp):
                    forwarded.update(ref_id(r) for r in inp.tensors.values())
        # What no consumer took (the emitted tensor too: the executor read it already).
        self._free(state.origin.get, [r for r in out.tensors.values() if ref_id(r) not in forwarded])
        if out.finished:
            st.open.discard(out.request_id)
            st.ended.add(out.request_id)
            st.sent.pop(out.request_id, None)
            self._release_inputs(state, s, out.request_id)
            if out.finish_reason and stage.final_output_type == "text":
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if out.request_id == state.rid and not st.inputs_closed:    # its stream ended early
                self._drop_unneeded(state, s)
            self._check_done(state, s)

    def _emit_final(self, state: RequestState, stage: StageConfig, out: m.Output) -> None:
        kind = stage.final_output_type
        po = PipelineOutput(request_id=state.rid, stage_id=stage.stage_id, modality=kind,
                            num_prompt_tokens=state.num_prompt_tokens)
        ref = None
        if kind == "text":
            if not out.token_ids:
                return
            po.token_ids = list(out.token_ids)
            po.logprobs, po.stop_reason = out.logprobs, out.stop_reason   # its stop token: no text (Generation)
        else:
            ref = next(iter(out.tensors.values()), None)
            if ref is None:
                return
            self.metrics.tensor_bytes(ref.nbytes, ref.transport)
            if kind == "audio":
                if out.sample_rate <= 0:
                    raise OmniError(f"{stage.label} sent audio without a sample rate")
                po.sample_rate = out.sample_rate
            if kind == "image" and stage.upstream():
                # The prompt an upstream stage wrote (the client's revised prompt), as it was sent.
                sent = state.stages[stage.stage_id].sent.get(out.request_id, ())
                po.prompt = next((inp.text for inp, _ in sent if inp.text is not None), None)
        if state.first_output_at is None and kind in state.req.modalities:   # not an audio answer's text
            state.first_output_at = self.clock()
            self.metrics.first_output(state.first_output_at - state.started_at)
        self._out.append(ev.Emit(state.rid, po, ref, state.origin.get(ref_id(ref), "") if ref else ""))

    def _route(self, state: RequestState, t: int, inp: procs.StageInput) -> bool:
        """Send or hold `inp` for stage t; False (dropped) when t already ended the request's stream."""
        st = state.stages[t]
        if inp.sub_id is None and state.rid in st.ended:   # early: max_tokens, a full KV cache, codec EOS
            return False
        for ref in inp.tensors.values():
            self.metrics.tensor_bytes(ref.nbytes, ref.transport)
        if inp.sub_id is not None:
            erid = f"{state.rid}/{inp.sub_id}"
            st.sub_order.append(erid)
            self._send(state, t, erid, inp, final=True)
        elif inp.stream:
            st.streamed = True
            self._send(state, t, state.rid, inp, final=False)
        elif st.pending is not None:
            prev, st.pending = st.pending, inp
            self._send(state, t, state.rid, prev, final=False)
        else:
            st.pending = inp
        return True

    # ------------------------------------------------------------ sends

    def _send(self, state: RequestState, s: int, erid: str, inp: procs.StageInput, final: bool) -> None:
        st = state.stages[s]
        stage = self.config.stage(s)
        replica = st.replica
        live = self.topology.replicas.get(replica.replica_id) if replica is not None else None
        # A draining replica finishes what it began (a stream's next piece, the next sentence),
        # it only takes nothing new; nor does one that went to sleep since it was picked.
        if live is None or live.state not in (("READY", "DRAINING") if st.started else ("READY",)) or (
                not st.started and live.is_sleeping):
            if st.started:
                raise StageFailed(s, replica.replica_id if replica else "?", "replica is gone", errors.UNAVAILABLE)
            if replica is not None:
                self._unhold(replica.replica_id, state.rid)
            # Shared-memory inputs were put for the old pick's host: their producer's.
            host = input_host(inp, state.origin, self.topology.replicas, stage.label)
            replica = st.replica = self.pick(s, state.req, host, st.not_again())
        # The stage's own sampling (the talker's temperature, piper's noise scales) over the request's;
        # the stage that takes the client's prompt had its defaults folded in by the frontend.
        overrides = state.req.stage_overrides.get(s, self._overrides[s])
        out_transport, out_tensors, out_devices = out_route(self.config, state, stage, self.host,
                                                            self._choose_transport)
        # Held after its first output while the final output it feeds has not started.
        finals = self._hold_for.get(s, ())
        hold_ms = stage.first_output_hold_ms if finals and not any(
            state.stages[t].first_output_at for t in finals if t in state.stages) else 0.0
        msg = m.AddRequest(request_id=erid, prompt_token_ids=inp.token_ids, text=inp.text,
                           sampling=state.req.sampling, tensors=dict(inp.tensors), final=final,
                           voice=inp.voice, speed=inp.speed, generated_ids=inp.generated_ids,
                           audio_out=inp.audio_out, emit_prompt_ids=inp.emit_prompt_ids, overrides=overrides,
                           out_transport=out_transport, out_tensors=out_tensors, out_devices=out_devices,
                           sent_at=time.time(), inline=dict(inp.inline), hold_ms=hold_ms, image=inp.image)
        st.started = True
        st.open.add(erid)
        st.sent.setdefault(erid, []).append((inp, final))
        if inp.tensors:
            st.refs_in.setdefault(erid, []).extend(
                (state.origin.get(ref_id(r), ""), r) for r in inp.tensors.values())
        self.by_replica.setdefault(replica.replica_id, set()).add(state.rid)
        self._out.append(ev.Send(state.rid, replica, msg))

    def _release_holds(self, state: RequestState, final: int) -> None:
        """Stage `final` made its first output of the request: the stages feeding it that hold
        the request's next work (first_output_hold_ms) may go on."""
        for s, finals in self._hold_for.items():
            st = state.stages.get(s)
            if final in finals and st is not None and st.open and st.replica is not None:
                self._out.append(ev.ReleaseHold(st.replica.replica_id, tuple(sorted(st.open))))

    # ------------------------------------------------------------ completion

    def _stage_done(self, state: RequestState, s: int) -> bool:
        st = state.stages[s]
        return st.inputs_closed and not st.open and st.pending is None

    def _output_done(self, state: RequestState, s: int) -> bool:
        """Stage s makes nothing more for the request: it is done, or it ended the request's
        stream early (the talker at its codec's end or max_tokens) while its inputs still come."""
        st = state.stages[s]
        return self._stage_done(state, s) or (state.rid in st.ended and not st.open)

    def _check_done(self, state: RequestState, s: int) -> None:
        """Cascade: a stage whose inputs are closed and that holds nothing is done; a stage whose
        upstream stages all make nothing more has its inputs closed (at once, not when the stages
        before those finish: code2wav's last chunk does not wait for the thinker's last token)."""
        if not self._output_done(state, s):
            return
        if state.stages[s].replica is not None:    # it holds nothing there now (load, ReplicaGone)
            self._unhold(state.stages[s].replica.replica_id, state.rid)
        for t in self.config.downstream(s):
            ts = state.stages.get(t)
            if ts is None or ts.inputs_closed:
                continue
            if all(self._output_done(state, u) for u in self.config.stage(t).upstream() if u in state.stages):
                ts.inputs_closed = True
                inp, ts.pending = ts.pending, None
                if state.rid in ts.ended:     # it ended early: no final piece, a held one is freed
                    self._free(state.origin.get, list(inp.tensors.values()) if inp else [])
                elif inp is not None:
                    self._send(state, t, state.rid, inp, final=True)
                elif ts.streamed:
                    self._send(state, t, state.rid, procs.StageInput(), final=True)
                self._check_done(state, t)
        if state.rid in self.requests and all(self._stage_done(state, x) for x in state.stages):
            reason = state.finish_reason or "stop"
            # The output that finished the request, when it is in this batch, carries the finish (a
            # stream puts finish_reason on the last token's chunk, as vLLM's server does).
            last = next((a for a in reversed(self._out) if isinstance(a, ev.Emit) and a.request_id == state.rid),
                        None)
            if last is not None:
                last.output.finished, last.output.finish_reason = True, reason
                last.output.stop_reason = state.stop_reason
            else:
                self._out.append(ev.Emit(state.rid, PipelineOutput(
                    request_id=state.rid, stage_id=s, modality="text", finished=True,
                    finish_reason=reason, num_prompt_tokens=state.num_prompt_tokens, stop_reason=state.stop_reason)))
            self._end(state, "ok")

    def _drop_unneeded(self, state: RequestState, s: int) -> None:
        """Stage s ended the request's stream early. A stage before it that feeds only stages that
        ended theirs, and whose own output the client did not ask for, now works for no one: it is
        aborted there and counts as done (an audio-only chat whose talker stopped while the thinker
        still writes). With text asked for, the thinker goes on: the answer needs all its text."""
        for u in self.config.stage(s).upstream():
            us, stage = state.stages.get(u), self.config.stage(u)
            if (us is None or state.rid in us.ended or self._stage_done(state, u)
                    or (stage.final_output and stage.final_output_type in state.req.modalities)
                    or any(state.rid not in state.stages[t].ended for t in self.config.downstream(u)
                           if t in state.stages)):
                continue
            self._out += cut_part(state, u)
            self._drop_unneeded(state, u)
            self._check_done(state, u)

    def _fail(self, state: RequestState, error: OmniError) -> None:
        if state.rid in self.requests:
            self._out.append(ev.Fail(state.rid, error))
            self._end(state, "failed")

    def _end(self, state: RequestState, outcome: str) -> None:
        """The request leaves: stages that still hold it are told to abort (a finished request
        holds nothing), the inputs they held are freed, and Finished closes it."""
        if self.requests.pop(state.rid, None) is None:
            return
        for s, st in state.stages.items():
            if st.replica is None:
                continue
            self._unhold(st.replica.replica_id, state.rid)
            if outcome != "ok" and st.started:
                ids = tuple(sorted(st.open | set(st.sub_order) | {state.rid}))
                self._out.append(ev.AbortStage(st.replica.replica_id, ids))
            for erid in list(st.refs_in):
                self._release_inputs(state, s, erid)
        seconds = self.clock() - state.started_at
        self.metrics.request_finished(outcome, seconds)
        self._out.append(ev.Finished(state.rid, outcome, seconds))

    def _unhold(self, replica_id: str, rid: str) -> None:
        holders = self.by_replica.get(replica_id)
        if holders is not None:
            holders.discard(rid)
            if not holders:
                del self.by_replica[replica_id]

    # ------------------------------------------------------------ tensors

    def _release_inputs(self, state: RequestState, s: int, erid: str) -> None:
        """The stage finished with these tensors: their producers may free them."""
        by_producer: dict[str, list] = {}
        for producer, ref in state.stages[s].refs_in.pop(erid, []):
            by_producer.setdefault(producer, []).append(ref)
        for producer, refs in by_producer.items():
            self._free(producer, refs)

    def _free(self, producer: str | Callable, refs: list[TensorRef]) -> None:
        self._out.extend(free_actions(producer, refs))
