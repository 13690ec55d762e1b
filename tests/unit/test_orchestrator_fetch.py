"""The frontend reads a final output's tensor from another host (tcp) off its event loop: one
request's slow read must not stall the frontend's other requests, its outputs still reach the
client in order, a request that leaves or fails while its read runs releases what it holds,
and a read's error is that request's, unless the request failed first (its own error is the
client's). The frontend's Free of a tensor being read waits for the read, and only for reads
of that producer's tensor (keys are unique per producing process). Small shared-memory reads stay
on the loop (a memcpy); large ones go to the threads too. After close, no read starts.

In-memory stage channels; a tensor consumer whose reads of chosen keys wait on a
threading.Event (with a deadline: on a loop-blocking frontend the test fails, it does not hang)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import msgspec
import pytest
import torch

from omni.config import parse
from omni.engines.base import SamplingParams
from omni.errors import OmniError, RequestTimeout, StageFailed
from omni.master.types import TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.transport.base import TensorRef, TransportError
from tests.unit.test_orchestrator_core import replica

pytestmark = pytest.mark.anyio

CONFIG = parse({"model": "m", "stages": [{"stage_id": 0, "engine": "count", "final_output": True,
                                          "final_output_type": "audio"}]}, source="test")
BLOCK_S = 3.0           # how long a blocked read waits for its release before it gives up
WAIT_S = 10.0           # the test's deadline for anything it waits on


class Consumer:
    """Reads return a tensor full of the ref's key; keys in `blocked` wait for `release`,
    keys in `fail` raise."""

    def __init__(self, blocked=(), fail=()):
        self.blocked, self.fail = set(blocked), set(fail)
        self.release = threading.Event()
        self.entered = {k: threading.Event() for k in self.blocked}
        self.read = {}                  # key -> threading.Event, set when its read returned
        self.gave_up = False
        self.threads: dict[int, int] = {}

    def get(self, ref: TensorRef) -> torch.Tensor:
        self.threads[ref.key] = threading.get_ident()
        if ref.key in self.fail:
            raise TransportError(f"tcp producer {ref.endpoint}: transfer of key {ref.key} failed")
        if ref.key in self.blocked:
            self.entered[ref.key].set()
            if not self.release.wait(BLOCK_S):
                self.gave_up = True
                raise TransportError("the read was never released")
        try:
            return torch.full(ref.shape, float(ref.key))
        finally:
            self.read.setdefault(ref.key, threading.Event()).set()


class FakeChannel:
    kind = "zmq"

    def __init__(self, r):
        self.replica_id, self.stage_id, self.closed = r.replica_id, r.stage_id, False
        self.posted: list = []
        self.changed = asyncio.Event()

    def post(self, msg) -> None:
        self.posted.append(msg)
        self.changed.set()

    def close(self) -> None:
        self.closed = True

    def freed(self) -> list[int]:
        return [k for msg in self.posted if isinstance(msg, m.FreeTensors) for k in msg.keys]

    def added(self) -> list[str]:
        return [msg.request_id for msg in self.posted if isinstance(msg, m.AddRequest)]

    async def until(self, check) -> None:
        async with asyncio.timeout(WAIT_S):
            while not check():
                self.changed.clear()
                await self.changed.wait()


def make(consumer: Consumer) -> tuple[Orchestrator, FakeChannel]:
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", [replica(0, "s0r0")], 1))
    orch = Orchestrator(CONFIG, frontend_id="fe", topology=topo, detokenize=lambda ids: "", consumer=consumer)
    ch = FakeChannel(replica(0, "s0r0"))

    def channel(r):
        orch._channels[r.replica_id] = ch
        return ch
    orch._channel = channel
    return orch, ch


@contextlib.asynccontextmanager
async def running(consumer: Consumer, made: tuple):
    """`made` (make's or make_replicas' orchestrator and channels) for a test; the orchestrator closed
    after it, its blocked reads released first."""
    orch = made[0]
    try:
        yield made
    finally:
        consumer.release.set()
        await orch.close()


async def started(orch: Orchestrator, ch: FakeChannel, rid: str):
    """The request's output iterator, once its AddRequest reached the stage."""
    it = aiter(orch.generate(PipelineRequest(request_id=rid, prompt_token_ids=[1], modalities=("audio",),
                                             sampling=SamplingParams(max_tokens=4), timeout_s=60)))
    first = asyncio.ensure_future(anext(it))
    await ch.until(lambda: rid in ch.added())
    return it, first


def chunk(orch: Orchestrator, ch: FakeChannel, rid: str, key: int, transport: str = "tcp",
          endpoint: str | None = None, **kw) -> None:
    """The stage sends an audio chunk of the request (as its channel's reader hands it over)."""
    endpoint = endpoint or ("h2:7000" if transport == "tcp" else "seg")
    ref = TensorRef(transport=transport, endpoint=endpoint, key=key, dtype="float32", shape=(2,), nbytes=8)
    orch._on_stage_message(ch, m.Output(request_id=rid, tensors={"audio": ref}, sample_rate=24000, **kw))


def samples(out) -> list[float]:
    return torch.frombuffer(bytearray(out.audio_pcm), dtype=torch.float32).tolist() if out.audio_pcm else []


async def test_a_slow_remote_read_leaves_the_other_requests_going_and_keeps_its_own_order():
    consumer = Consumer(blocked={1})
    async with running(consumer, make(consumer)) as (orch, ch):
        a, a_first = await started(orch, ch, "a")
        b, b_first = await started(orch, ch, "b")
        chunk(orch, ch, "a", 1)                      # its read waits (a far host, a slow link)
        assert consumer.entered[1].wait(WAIT_S)
        chunk(orch, ch, "a", 3, finished=True)       # its next chunk's read ends first
        chunk(orch, ch, "b", 2, finished=True)
        out = await asyncio.wait_for(b_first, WAIT_S)
        assert samples(out) == [2.0, 2.0] and out.finished
        # b went all the way while a's read still waited: the loop was not blocked in it.
        assert not consumer.gave_up and not consumer.release.is_set() and 2 in ch.freed()
        assert await asyncio.to_thread(consumer.read.setdefault(3, threading.Event()).wait, WAIT_S)
        assert not a_first.done()                     # chunk 3 is read, but chunk 1 comes first
        await ch.until(lambda: 3 in ch.freed())       # its free follows the read, on the loop
        assert 1 not in ch.freed()                    # a tensor being read is not freed under it
        consumer.release.set()
        first = await asyncio.wait_for(a_first, WAIT_S)
        second = await asyncio.wait_for(anext(a), WAIT_S)
        assert (samples(first), first.finished, samples(second), second.finished) == ([1.0] * 2, False,
                                                                                       [3.0] * 2, True)
        await ch.until(lambda: 1 in ch.freed())
        assert orch.metrics.outcomes == {"ok": 2, "aborted": 0, "failed": 0}
        await a.aclose(), await b.aclose()
        assert not orch._sinks and not orch._fetch._reading and not orch._fetch._deferred


async def test_a_request_that_leaves_while_its_read_runs_is_aborted_and_frees_the_tensor_after_the_read():
    # The frontend's FreeTensors waits for the read. The stage itself frees what the request owns
    # when it takes the Abort (omni/stage/intake.py), read or not: a read that loses that race fails,
    # and goes nowhere here (the client left).
    consumer = Consumer(blocked={5})
    async with running(consumer, make(consumer)) as (orch, ch):
        it, first = await started(orch, ch, "c")
        chunk(orch, ch, "c", 5)
        assert consumer.entered[5].wait(WAIT_S)
        first.cancel()                               # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        await it.aclose()
        assert [msg.request_ids for msg in ch.posted if isinstance(msg, m.Abort)] == [["c"]]
        assert 5 not in ch.freed() and not orch._sinks and orch.metrics.outcomes["aborted"] == 1
        consumer.release.set()
        await ch.until(lambda: 5 in ch.freed())
        assert not orch._fetch._reading and not orch._fetch._deferred


async def test_a_request_that_times_out_while_its_read_runs_fails_with_the_timeout():
    consumer = Consumer(blocked={6})
    async with running(consumer, make(consumer)) as (orch, ch):
        it = aiter(orch.generate(PipelineRequest(request_id="t", prompt_token_ids=[1], modalities=("audio",),
                                                 sampling=SamplingParams(max_tokens=4), timeout_s=0.5)))
        first = asyncio.ensure_future(anext(it))
        await ch.until(lambda: "t" in ch.added())
        chunk(orch, ch, "t", 6)
        with pytest.raises(RequestTimeout):
            await asyncio.wait_for(first, WAIT_S)
        await it.aclose()
        assert [msg.request_ids for msg in ch.posted if isinstance(msg, m.Abort)] == [["t"]]
        consumer.release.set()
        await ch.until(lambda: 6 in ch.freed())
        assert not orch._sinks and not orch._fetch._reading and not orch._fetch._deferred


async def test_a_failed_remote_read_fails_its_request_only():
    consumer = Consumer(fail={7})
    async with running(consumer, make(consumer)) as (orch, ch):
        d, d_first = await started(orch, ch, "d")
        e, e_first = await started(orch, ch, "e")
        chunk(orch, ch, "d", 7, finished=True)      # the last output: the core has ended the request ok
        chunk(orch, ch, "e", 8, finished=True)
        with pytest.raises(OmniError, match="transfer of key 7 failed"):
            await asyncio.wait_for(d_first, WAIT_S)
        assert samples(await asyncio.wait_for(e_first, WAIT_S)) == [8.0, 8.0]
        await ch.until(lambda: 7 in ch.freed())
        await d.aclose(), await e.aclose()


async def test_a_shared_memory_read_is_made_on_the_loop_in_order():
    consumer = Consumer()
    async with running(consumer, make(consumer)) as (orch, ch):
        it, first = await started(orch, ch, "f")
        chunk(orch, ch, "f", 4, transport="shm", finished=True)
        assert consumer.threads[4] == threading.get_ident() and 4 in ch.freed()   # read before it was freed
        assert samples(await asyncio.wait_for(first, WAIT_S)) == [4.0, 4.0]
        await it.aclose()


@pytest.mark.parametrize("transport", ["shm", "cuda_ipc"])
async def test_a_large_shared_memory_read_is_made_off_the_loop_and_its_free_waits_for_it(transport):
    """A finished image or video was copied whole on the loop (224 MB: 344 ms with every other request of the
    frontend stalled). A same-host ref over LOOP_READ_BYTES is read on the fetch threads as a remote one is."""
    from omni.orchestrator.fetch import LOOP_READ_BYTES

    consumer = Consumer(blocked={5})
    async with running(consumer, make(consumer)) as (orch, ch):
        it, first = await started(orch, ch, "g")
        n = LOOP_READ_BYTES // 4 + 1
        ref = TensorRef(transport=transport, endpoint="seg", key=5, dtype="float32", shape=(n,), nbytes=n * 4)
        orch._on_stage_message(ch, m.Output(request_id="g", tensors={"audio": ref}, sample_rate=24000, finished=True))
        # the loop goes on (this test runs on it) while the read waits, and the tensor is not freed under it
        assert await asyncio.to_thread(consumer.entered[5].wait, WAIT_S)
        assert consumer.threads[5] != threading.get_ident() and 5 not in ch.freed()
        consumer.release.set()
        assert samples(await asyncio.wait_for(first, WAIT_S)) == [5.0] * n
        await ch.until(lambda: 5 in ch.freed())
        await it.aclose()


def make_replicas(consumer: Consumer, *replicas) -> tuple[Orchestrator, list[FakeChannel]]:
    """Channels made as the orchestrator asks for them: a new one for a replica whose last closed."""
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", list(replicas), 1))
    orch = Orchestrator(CONFIG, frontend_id="fe", topology=topo, detokenize=lambda ids: "", consumer=consumer)
    made: list[FakeChannel] = []

    def channel(r):
        ch = orch._channels.get(r.replica_id)
        if ch is None or ch.closed:
            ch = orch._channels[r.replica_id] = FakeChannel(r)
            made.append(ch)
        return ch
    orch._channel = channel
    return orch, made


class SlowHost(Consumer):
    """Reads from `slow` (an endpoint) wait for `release`."""

    def __init__(self, slow: str):
        super().__init__()
        self.slow, self.waiting = slow, threading.Event()

    def get(self, ref: TensorRef) -> torch.Tensor:
        if ref.endpoint == self.slow:
            self.waiting.set()
            if not self.release.wait(WAIT_S):
                raise TransportError("the read was never released")
        return torch.full(ref.shape, float(ref.key))


async def test_a_free_waits_only_for_reads_of_its_own_producers_tensor_not_of_the_same_key_elsewhere():
    consumer = SlowHost("h2:7000")
    replicas = replica(0, "s0r0", host="h2"), replica(0, "s0r1", host="h3")
    async with running(consumer, make_replicas(consumer, *replicas)) as (orch, made):
        a, a_first = await started_on(orch, made, "a")
        b, b_first = await started_on(orch, made, "b")
        ch_a, ch_b = made
        assert (ch_a.replica_id, ch_b.replica_id) == ("s0r0", "s0r1")
        chunk(orch, ch_a, "a", 1, endpoint="h2:7000", finished=True)     # s0r0's key 1: its read waits
        assert await asyncio.to_thread(consumer.waiting.wait, WAIT_S)
        chunk(orch, ch_b, "b", 1, endpoint="h3:7000", finished=True)     # s0r1's key 1: another tensor
        assert samples(await asyncio.wait_for(b_first, WAIT_S)) == [1.0, 1.0]
        assert ch_b.freed() == [1] and not consumer.release.is_set()   # not held behind s0r0's read
        assert ch_a.freed() == []
        consumer.release.set()
        assert samples(await asyncio.wait_for(a_first, WAIT_S)) == [1.0, 1.0]
        assert ch_a.freed() == [1] and ch_b.freed() == [1]
        await a.aclose(), await b.aclose()
        assert not orch._fetch._reading and not orch._fetch._deferred


async def test_a_free_waiting_for_a_read_is_dropped_when_its_replica_restarted_under_the_same_id():
    consumer = SlowHost("h2:7000")
    old = replica(0, "s0r0", host="h2")
    async with running(consumer, make_replicas(consumer, old)) as (orch, made):
        a, a_first = await started_on(orch, made, "a")
        chunk(orch, made[0], "a", 1, endpoint="h2:7000", finished=True)   # read waits; its Free waits for it
        assert await asyncio.to_thread(consumer.waiting.wait, WAIT_S)
        # The replica restarts under its id: its keys start at 1 again and name other requests' tensors.
        orch.topology.apply(TopologyEvent("REMOVED", [old], 2))
        orch.topology.apply(TopologyEvent("ADDED", [msgspec.structs.replace(old, pid=2)], 3))
        assert made[0].closed
        b, b_first = await started_on(orch, made, "b")
        assert len(made) == 2 and made[1].replica_id == "s0r0"
        consumer.release.set()
        assert samples(await asyncio.wait_for(a_first, WAIT_S)) == [1.0, 1.0]
        assert made[1].freed() == [] and made[0].freed() == []       # not the new process's key 1
        assert not orch._fetch._reading and not orch._fetch._deferred
        b_first.cancel()
        await asyncio.wait((b_first,))
        await a.aclose(), await b.aclose()


async def test_a_request_that_fails_while_its_read_runs_gets_its_failure_not_the_reads_error():
    class Freed(Consumer):
        """What a tcp read gets once the stage's Abort freed the request's tensors."""

        def get(self, ref):
            self.entered.setdefault(ref.key, threading.Event()).set()
            self.release.wait(WAIT_S)
            raise TransportError(f"tcp producer {ref.endpoint} has no tensor with key {ref.key}")
    consumer = Freed()
    async with running(consumer, make(consumer)) as (orch, ch):
        it, first = await started(orch, ch, "x")
        chunk(orch, ch, "x", 5)
        assert await asyncio.to_thread(lambda: consumer.entered.setdefault(5, threading.Event()).wait(WAIT_S))
        orch._on_stage_message(ch, m.RequestError(request_id="x", message="engine step failed: CUDA OOM",
                                                  stage_id=0, replica_id="s0r0", kind="internal"))
        assert [msg.request_ids for msg in ch.posted if isinstance(msg, m.Abort)] == [["x"]]
        consumer.release.set()
        with pytest.raises(StageFailed, match="CUDA OOM"):
            await asyncio.wait_for(first, WAIT_S)
        await it.aclose()
        assert orch.metrics.outcomes == {"ok": 0, "aborted": 0, "failed": 1}
        await ch.until(lambda: 5 in ch.freed())
        assert not orch._sinks and not orch._fetch._reading and not orch._fetch._deferred


async def test_a_read_after_the_fetcher_closed_fails_its_request_and_reads_run_on_daemon_threads():
    consumer = Consumer()
    async with running(consumer, make(consumer)) as (orch, ch):
        it, first = await started(orch, ch, "g")
        chunk(orch, ch, "g", 2)
        assert samples(await asyncio.wait_for(first, WAIT_S)) == [2.0, 2.0]
        fetchers = [t for t in threading.enumerate() if t.name.startswith("omni-fetch")]
        assert fetchers and all(t.daemon for t in fetchers)   # a stuck read does not hold up the exit
        orch._fetch.close()                  # as the frontend's shutdown does
        chunk(orch, ch, "g", 3, finished=True)
        with pytest.raises(OmniError, match="shutting down"):
            await asyncio.wait_for(anext(it), WAIT_S)
        assert 3 not in consumer.threads and orch._fetch._pool is None
        await it.aclose()


async def started_on(orch: Orchestrator, made: list[FakeChannel], rid: str):
    """The request's output iterator, once its AddRequest reached a stage replica."""
    it = aiter(orch.generate(PipelineRequest(request_id=rid, prompt_token_ids=[1], modalities=("audio",),
                                             sampling=SamplingParams(max_tokens=4), timeout_s=60)))
    first = asyncio.ensure_future(anext(it))
    async with asyncio.timeout(WAIT_S):
        while not any(rid in c.added() for c in made):
            await asyncio.sleep(0.001)
    return it, first


async def test_a_replica_going_suspect_while_its_tensor_is_read_keeps_its_channel_for_the_free():
    """A same-host stage frees what it published to a frontend whose channel closes: closed at SUSPECT (it may
    be alive), the slot under this read could be reused. Open until the read ends and its Free went out."""
    consumer = SlowHost("h2:7000")
    r = replica(0, "s0r0", host="h2")
    async with running(consumer, make_replicas(consumer, r)) as (orch, made):
        a, a_first = await started_on(orch, made, "a")
        chunk(orch, made[0], "a", 1, endpoint="h2:7000", finished=True)   # read waits; its Free waits for it
        assert await asyncio.to_thread(consumer.waiting.wait, WAIT_S)
        orch.topology.apply(TopologyEvent("UPDATED", [msgspec.structs.replace(r, state="SUSPECT")], 2))
        assert not made[0].closed
        consumer.release.set()
        assert samples(await asyncio.wait_for(a_first, WAIT_S)) == [1.0, 1.0]
        assert made[0].freed() == [1] and made[0].closed
        await a.aclose()
