"""Per-request state of the orchestrator core, and the pure helpers it is built from."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from omni import errors
from omni import processors as procs
from omni.config import DeployConfig, StageConfig
from omni.errors import BadRequest, OmniError, StageFailed, Unavailable
from omni.master.types import ReplicaInfo
from omni.orchestrator import events as ev
from omni.orchestrator.types import PipelineRequest
from omni.transport.base import SAME_HOST_ONLY, TensorRef


def load_processor(path: str | None) -> Callable:
    if not path:
        return procs.passthrough
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OmniError(f"processor {path!r} cannot be loaded: {e}") from None


def ref_id(ref: TensorRef) -> tuple[str, str, int]:
    return ref.transport, ref.endpoint, ref.key


def reads_from(state: "RequestState", replica_id: str) -> bool:
    """A stage of the request still holds (or has buffered to send) tensors that `replica_id` published."""
    for st in state.stages.values():
        if any(producer == replica_id for held in st.refs_in.values() for producer, _ in held):
            return True
        if any(state.origin.get(ref_id(r)) == replica_id
               for buffered in st.sub_buffer.values() for b in buffered for r in b.tensors.values()):
            return True
    return False


@dataclass
class StageState:
    replica: ReplicaInfo | None = None
    open: set[str] = field(default_factory=set)        # engine request ids sent and not finished
    inputs_closed: bool = False
    started: bool = False                              # something was sent
    pending: procs.StageInput | None = None            # held back to mark the last piece final
    refs_in: dict[str, list] = field(default_factory=dict)   # erid -> [(producer, ref)] sent here
    proc_state: dict = field(default_factory=dict)
    sub_order: list[str] = field(default_factory=list)
    sub_buffer: dict[str, list] = field(default_factory=dict)
    first_output_at: float | None = None
    streamed: bool = False                             # pieces went out at once; close with an empty final
    ended: set[str] = field(default_factory=set)       # engine request ids it finished: nothing more goes there
    # Inputs sent per engine request id, kept until it finishes, so a replica that dies before
    # any output can be replaced by sending them again (descriptors only; producers keep the bytes).
    sent: dict[str, list] = field(default_factory=dict)
    # Replica processes (picking.process: a restart is another) it was moved off while unheard (SUSPECT,
    # gone: it may have finished it): never back there. And those that refused it (asleep, draining,
    # stopping: it never ran there) since the last such move: not after another refusal, so two refusing
    # replicas do not bounce it while this frontend's topology lags.
    ran_on: set[tuple] = field(default_factory=set)
    refused_by: set[tuple] = field(default_factory=set)

    def not_again(self, refused: bool = True) -> set[tuple]:
        return self.ran_on | self.refused_by if refused else self.ran_on


class RequestState:
    def __init__(self, req: PipelineRequest, needed: list[int], now: float):
        self.req = req
        self.rid = req.request_id
        self.stages = {s: StageState() for s in needed}
        self.started_at = now
        self.first_output_at: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens: int | None = None
        # Which replica produced each tensor this request saw, so its consumers' frees go back there.
        self.origin: dict[tuple[str, str, int], str] = {}


class ProcessorContext:
    """What a processor sees of the request (omni.processors.Context)."""

    def __init__(self, detokenize: Callable[[list[int]], str], request: PipelineRequest):
        self.detokenize = detokenize
        self.request = request


def needed_stages(config: DeployConfig, req: PipelineRequest) -> list[int]:
    """The stages making the requested modalities and their ancestors, from the entry stage on."""
    finals = []
    for modality in req.modalities:
        stage = config.final_stage(modality)
        if stage is None:
            raise BadRequest(f"modality {modality!r} is not produced by this pipeline "
                             f"(it produces {config.modalities()})")
        finals.append(stage.stage_id)
    needed: set[int] = set()
    todo = list(finals)
    while todo:
        s = todo.pop()
        if s in needed or s < req.entry_stage:
            continue
        needed.add(s)
        todo.extend(config.stage(s).upstream())
    if req.entry_stage not in needed:
        raise BadRequest(f"modalities {list(req.modalities)} are not reachable from stage {req.entry_stage}")
    return sorted(needed)


def finals_below(config: DeployConfig, s: int) -> frozenset[int]:
    """The final-output stages that stage s feeds, directly or not (needed_stages walks the other way)."""
    below: set[int] = set()
    todo = list(config.downstream(s))
    while todo:
        t = todo.pop()
        if t not in below:
            below.add(t)
            todo.extend(config.downstream(t))
    return frozenset(t for t in below if config.stage(t).final_output)


def free_actions(producer: str | Callable, refs: list[TensorRef]) -> list[ev.Free]:
    """Free `refs` at their producer (a replica id, or a lookup from a ref's id to one)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for ref in refs:
        rep = producer(ref_id(ref), "") if callable(producer) else producer
        if rep:
            groups.setdefault((rep, ref.transport, ref.incarnation), []).append(ref.key)
    return [ev.Free(rep, transport, tuple(keys), inc) for (rep, transport, inc), keys in groups.items()]


def cut_part(state: RequestState, s: int, keep_published: bool = False) -> list[ev.Action]:
    """End stage s's part of the request where it is: an AbortStage to its replica (when it was sent
    something), every engine request id of it ended (what it sent before it took the Abort is only
    freed), and what it held or was sent freed. keep_published: the stages after it still read what
    it sent them, so its replica keeps that (freed as a finished stage's, when they are done with it)."""
    st = state.stages[s]
    ids = st.open | set(st.sub_order) | {state.rid}
    acts: list[ev.Action] = []
    if st.started and st.replica is not None:
        acts.append(ev.AbortStage(st.replica.replica_id, tuple(sorted(ids)), keep_published))
    st.ended |= ids
    st.open.clear()
    st.sub_order.clear()
    st.sent.clear()
    for buffered in st.sub_buffer.values():
        for b in buffered:
            acts += free_actions(state.origin.get, list(b.tensors.values()))
    st.sub_buffer.clear()
    by_producer: dict[str, list] = {}
    for producer, ref in (x for held in st.refs_in.values() for x in held):
        by_producer.setdefault(producer, []).append(ref)
    st.refs_in.clear()
    for producer, refs in by_producer.items():
        acts += free_actions(producer, refs)
    return acts


def to_client(stage: StageConfig, req: PipelineRequest) -> bool:
    """The stage's final output goes to the client: a modality it asked for, or the text of an answer
    it asked to hear (the transcript; usage counts its tokens)."""
    kind = stage.final_output_type
    return stage.final_output and (kind in req.modalities or (kind == "text" and "audio" in req.modalities))


def input_host(inp: procs.StageInput, origin: dict, replicas: dict[str, ReplicaInfo], label: str) -> str | None:
    """The host whose replicas can read `inp` (its shm / cuda_ipc tensors' producer's), None: any."""
    for ref in inp.tensors.values():
        if ref.transport in SAME_HOST_ONLY:
            producer = replicas.get(origin.get(ref_id(ref), ""))
            if producer is None:
                raise Unavailable(f"{label}: the replica holding its input's {ref.transport} tensors is gone")
            return producer.host
    return None


def lost_inputs(s: int, dead: str, sent: dict, origin: dict, replicas: dict[str, ReplicaInfo]) -> StageFailed | None:
    """Why stage s's part of a request cannot move from replica `dead`: a replica that made tensors
    of its inputs so far (`sent`) serves no more (not READY/DRAINING, or gone), so they cannot be
    read again elsewhere. None: nothing lost."""
    lost = set()
    for items in sent.values():
        for inp, _ in items:
            for ref in inp.tensors.values():
                producer = origin.get(ref_id(ref))
                r = replicas.get(producer) if producer else None
                if producer and (r is None or r.state not in ("READY", "DRAINING")):
                    lost.add(f"{producer} ({r.state if r else 'gone'})")
    if not lost:
        return None
    return StageFailed(s, dead, "replica is gone; not replayed: the replica that made its inputs is gone too: "
                       + ", ".join(sorted(lost)), errors.UNAVAILABLE)


TENSOR_OUTPUTS = ("audio", "embedding", "image", "video")     # final outputs read from a tensor, not token ids


def out_route(config: DeployConfig, state: RequestState, stage: StageConfig, host: str,
              choose_transport: Callable[[str, str, str | None], str]) -> tuple[str, bool, str]:
    """Where this stage's output tensors go for this request, if anyone reads them, and the
    consuming stage's `devices` when `auto` picked shm for it: a CUDA tensor then takes
    cuda_ipc if the consumer sees its GPU (the producing stage decides, per tensor:
    omni.transport.factory.auto_transport). `host` is the frontend's."""
    me = state.stages[stage.stage_id].replica
    my_host = me.host if me else host
    for t in config.downstream(stage.stage_id):
        if t in state.stages:
            consumer = state.stages[t].replica
            conn = stage.connectors.get(str(t))
            configured = conn.transport if conn and conn.transport != "auto" else None
            chosen = choose_transport(my_host, consumer.host if consumer else my_host, configured)
            devices = config.stage(t).devices if configured is None and chosen == "shm" else ""
            return chosen, True, devices
    if stage.final_output and stage.final_output_type in TENSOR_OUTPUTS:
        # the frontend wants host tensors: no devices, so no cuda_ipc
        return choose_transport(my_host, host, None), True, ""
    return "", False, ""
