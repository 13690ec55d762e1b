"""The stage worker's records: a request in flight, output held back, the counters it reports; the engine's
request made of an AddRequest."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from omni.engines.base import EngineOutput, EngineRequest, facts_of
from omni.metrics import BATCH_BUCKETS, BATCH_KEY, ENGINE_GAUGE, STEP_BUCKETS, STEP_KEY, Histogram
from omni.ratelog import RateLimitedLog
from omni.stage import messages as m
from omni.transport.base import TransportError

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    frontend: bytes
    added_at: float
    out_transport: str
    out_tensors: bool = True
    started: bool = False
    hold_s: float = 0.0      # held this long after the first output (AddRequest.hold_ms)
    out_devices: str = ""    # AddRequest.out_devices
    touched_at: float = 0.0  # its last input or output (expiry.IdleRequests); 0: added_at

    def __post_init__(self) -> None:
        self.touched_at = self.touched_at or self.added_at


class RecentBases:
    """The base ids ("r1" of "r1/s2") of the latest `cap` requests taken. A draining stage still
    takes the later parts of requests it began: a stream's next piece, or the next sentence of a
    request whose previous one it finished (so nothing of it is in flight at that moment).
    Also the exact ids of the latest `cap` requests the engine finished (`end`, `ended`): a piece
    of a stream that arrives after the stage ended it (the talker at max_tokens or its codec's end
    while the thinker still streams, before the frontend heard of the end) is a late piece, never a
    new request (request ids are unique)."""

    def __init__(self, cap: int = 4096):
        self.cap = cap
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()

    def end(self, rid: str) -> None:
        self._ended[rid] = None
        if len(self._ended) > self.cap:
            self._ended.popitem(last=False)

    def ended(self, rid: str) -> bool:
        return rid in self._ended

    def add(self, rid: str) -> None:
        base = rid.split("/", 1)[0]
        self._ids[base] = None
        self._ids.move_to_end(base)
        if len(self._ids) > self.cap:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid.split("/", 1)[0] in self._ids


@dataclass
class WorkerStats:
    requests_total: int = 0
    errors_total: int = 0
    steps: int = 0
    step_s_total: float = 0.0
    tensor_bytes_out: int = 0
    tensor_bytes_in: int = 0
    by_transport: dict[str, float] = field(default_factory=dict)   # "tensor_bytes_out.tcp" -> bytes
    stalls: int = 0                 # times output had to wait for consumers (backpressure)
    stall_s_total: float = 0.0
    # Steps of an engine that computes in this process, with work: seconds and requests stepped.
    step_hist: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    batch_hist: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))

    def count(self, key: str, n: int) -> None:
        self.by_transport[key] = self.by_transport.get(key, 0.0) + n

    def engine_step(self, seconds: float, batch: int) -> None:
        self.step_hist.observe(seconds)
        self.batch_hist.observe(batch)

    def step_report(self) -> dict[str, float]:
        if not self.batch_hist.sum:
            return {}
        return {**self.step_hist.to_flat(STEP_KEY), **self.batch_hist.to_flat(BATCH_KEY)}


@dataclass
class HeldOutput:
    """Output that could not go out yet: its tensors did not fit the producer (`out`
    set) or the frontend's queue was full (`frame` set, tensors already published).
    `ident`: the frontend it goes to."""
    rid: str
    since: float
    ident: bytes
    out: EngineOutput | None = None
    step_s: float = 0.0
    frame: bytes = b""


def load_report(w: Any) -> dict:
    """A StageWorker's load: on its loop thread only (it reads the engine's request tables, which that thread
    changes); the keep-alive thread sends a LoadSnapshot's copy."""
    return {
        "queue_len": w.engine.num_waiting(),
        "in_flight": len(w._reqs) + w._reads.new_requests(w._reqs),   # with those waiting for an input read
        "requests_total": w.stats.requests_total,
        "cpu_seconds": time.process_time(),
        "is_sleeping": w.engine.is_sleeping(),
        "draining": w.draining,
        "extra": {
            "steps": float(w.stats.steps),
            "step_s_total": w.stats.step_s_total,
            "tensor_bytes_out": float(w.stats.tensor_bytes_out),
            "tensor_bytes_in": float(w.stats.tensor_bytes_in),
            "stalls": float(w.stats.stalls),
            "stall_s_total": w.stats.stall_s_total,
            "held_outputs": float(len(w._held)),
            **w.stats.by_transport,
            **w.stats.step_report(),
            **{f"{ENGINE_GAUGE}{k}": v for k, v in w.engine.load_extra().items()},
        },
    }


class LoadSnapshot:
    """The stage's load as its loop thread last took it (`take`, at most every `every_s` through `due`, and after
    each master command), for the keep-alive thread (`read`), which so never calls into the engine: reading a
    stream engine's open requests from there while the loop added or ended one raised "OrderedDict mutated
    during iteration", and the heartbeat went out without a load (draining and sleep read as off). A failed
    take keeps the last load."""

    def __init__(self, worker: Any, every_s: float = 0.05):
        self._w, self.every_s = worker, every_s
        self._load: dict = {}
        self._at = 0.0
        self._errors = RateLimitedLog(logger)
        self.take()

    def take(self) -> None:
        try:
            self._load = load_report(self._w)
        except Exception as e:
            self._errors.warning("%s: reading the load failed, the last one stands: %s", self._w.stage.label, e)
        self._at = time.monotonic()

    def due(self) -> None:
        if time.monotonic() - self._at >= self.every_s:
            self.take()

    def read(self) -> dict:
        if not self._load:   # raised: the keep-alive then sends its last good load or none, never an empty one
            raise RuntimeError("the stage's load was never read")
        return {**self._load, "cpu_seconds": time.process_time()}


def engine_request(msg: m.AddRequest, consumer: Any, stats: WorkerStats, read: Any = None) -> EngineRequest:
    """The engine's request for an AddRequest, its tensors read through `consumer` (counted in `stats`);
    `read`: those already read off the loop (input_reads.py), or that read's error, raised here."""
    if isinstance(read, BaseException):
        raise read
    tensors = {}
    for name, ref in msg.tensors.items():
        if consumer is None:
            raise TransportError("this stage has no tensor consumer")
        tensors[name] = read[name] if read and name in read else consumer.get(ref)
        stats.tensor_bytes_in += ref.nbytes
        stats.count(f"tensor_bytes_in.{ref.transport}", ref.nbytes)
    for name, t in msg.inline.items():
        tensors[name] = m.inline_tensor(t)
    return EngineRequest(request_id=msg.request_id, prompt_token_ids=msg.prompt_token_ids, text=msg.text,
                         sampling=msg.sampling, tensors=tensors, **facts_of(msg))
