"""A replica that dies before a request's first output: the orchestrator sends the request
to another replica of the entry stage (nothing of it was seen, so it is safe). After the
first output it fails, naming the stage and replica. Real StageWorkers on real sockets;
the topology events are fed by hand in place of the master."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omni.config import parse
from omni.engines.base import SamplingParams
from omni.errors import StageFailed, Unavailable
from omni.master.types import ReplicaInfo, TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage.worker import StageWorker
from tests.unit.test_stage_worker import CountEngine

CONFIG = parse({"model": "m", "stages": [{"stage_id": 0, "engine": "count", "final_output": True,
                                          "final_output_type": "text"}]}, source="test")


class StallEngine(CountEngine):
    """Emits `emit` outputs, then holds every request without output (a replica about to die)."""

    def __init__(self, emit: int):
        super().__init__()
        self.emit = emit
        self.added = threading.Event()

    def add_request(self, r) -> None:
        super().add_request(r)
        self.added.set()

    def step(self):
        if self.emit <= 0:
            return []
        self.emit -= 1
        return super().step()


def info(w: StageWorker, replica_id: str, state: str = "READY", stage_id: int = 0) -> ReplicaInfo:
    return ReplicaInfo(stage_id=stage_id, replica_id=replica_id, replica_index=int(replica_id[-1]), role="STAGE",
                       host="127.0.0.1", pid=1, endpoints={"channel": w.endpoint}, state=state, queue_len=0,
                       in_flight=0, requests_total=0, cpu_seconds=0.0, is_sleeping=False, draining=False,
                       extra={}, heartbeat_age_s=0.0, version="test", capabilities={})


@pytest.fixture
def running():
    """start(config, [(stage_id, replica_id, engine), ...]) -> one running StageWorker each,
    stopped at teardown."""
    workers, threads = [], []

    def start(config, specs) -> list[StageWorker]:
        for stage_id, rid, engine in specs:
            w = StageWorker(config.stage(stage_id), engine, replica_id=rid)
            t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
            t.start()
            workers.append(w)
            threads.append(t)
        return list(workers)
    yield start
    for w in workers:
        w.stop()
    for t in threads:
        t.join(10)


def replicas(running, emit: int) -> list[StageWorker]:
    """Replica s0r0 stalls after `emit` outputs; s0r1 counts normally."""
    return running(CONFIG, [(0, "s0r0", StallEngine(emit)), (0, "s0r1", CountEngine())])


async def run(workers, after_first_output: bool) -> tuple[list, BaseException | None, Orchestrator]:
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", [info(workers[0], "s0r0"), info(workers[1], "s0r1")], 1))
    orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "")
    req = PipelineRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=3),
                          timeout_s=30)
    outs, error = [], None
    first = asyncio.Event()

    async def consume():
        async for out in orch.generate(req):
            outs.append(out)
            first.set()

    task = asyncio.create_task(consume())
    if after_first_output:
        await asyncio.wait_for(first.wait(), 10)
    else:
        added = workers[0].engine.added
        assert await asyncio.to_thread(added.wait, 10), "the first replica never got the request"
    # The master saw its keep-alive stream break.
    topo.apply(TopologyEvent("UPDATED", [info(workers[0], "s0r0", "SUSPECT")], 2))
    try:
        await asyncio.wait_for(task, 30)
    except StageFailed as e:
        error = e
    await orch.close()
    return outs, error, orch


def aborted(engine, rid: str, timeout: float = 5.0) -> bool:
    """Whether `rid` was aborted in `engine` (a worker thread's) within `timeout`."""
    deadline = time.monotonic() + timeout
    while rid not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    return rid in engine.aborted


def test_a_request_is_replayed_when_its_replica_dies_before_any_output(running):
    workers = replicas(running, emit=0)
    outs, error, orch = asyncio.run(run(workers, after_first_output=False))
    assert error is None
    assert [o.token_ids for o in outs if o.token_ids] == [[11], [12], [13]] and outs[-1].finished
    assert orch.metrics.replays == {0: 1}
    assert 'omni_stage_replays_total{frontend="fe-test",stage="0"} 1' in orch.metrics.render("fe-test")
    # Only SUSPECT, the first replica is alive: the request was aborted there, not left open for good.
    assert aborted(workers[0].engine, "r1")


def test_after_the_first_output_it_fails_naming_stage_and_replica(running):
    workers = replicas(running, emit=1)
    outs, error, orch = asyncio.run(run(workers, after_first_output=True))
    assert isinstance(error, StageFailed)
    assert "stage 0" in str(error) and "s0r0" in str(error), str(error)
    assert [o.token_ids for o in outs] == [[11]]
    assert orch.metrics.replays == {}
    assert aborted(workers[0].engine, "r1")     # posted before its channel closed, not dropped


def test_a_frontend_that_shuts_down_aborts_what_it_had_in_flight_on_zmq(running):
    """close() posts the Aborts and then closes the channels: they go out (linger), so the stage
    does not keep the request open; with LINGER 0 they were dropped."""
    workers = running(CONFIG, [(0, "s0r0", StallEngine(0))])

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [info(workers[0], "s0r0")], 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "")
        req = PipelineRequest(request_id="r3", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=3),
                              timeout_s=30)

        async def consume():
            async for _ in orch.generate(req):
                pass
        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(workers[0].engine.added.wait, 10), "the replica never got the request"
        await orch.close()
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(task, 10)

    asyncio.run(go())
    assert aborted(workers[0].engine, "r3")


# ---- a downstream stage: its input was complete when its replica died

PIPE = parse({"model": "m", "stages": [
    {"stage_id": 0, "engine": "count"},
    {"stage_id": 1, "engine": "count", "inputs": [0], "processor": "tests.unit.test_orchestrator_replay:collect_all",
     "final_output": True, "final_output_type": "text"}]}, source="test")


def collect_all(ctx, state, out):
    """Stage 0's tokens as one input for stage 1, once stage 0 is done."""
    from omni.processors import StageInput

    state.setdefault("ids", []).extend(out.token_ids)
    return [StageInput(token_ids=list(state["ids"]))] if out.finished else []


def test_a_downstream_stage_is_replayed_when_its_input_was_complete(running):
    specs = [(0, "s0r0", CountEngine()), (1, "s1r0", StallEngine(0)), (1, "s1r1", CountEngine())]
    workers = running(PIPE, specs)

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [info(w, rid, stage_id=st) for w, (st, rid, _) in zip(workers, specs)],
                                 1))
        orch = Orchestrator(PIPE, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "")
        req = PipelineRequest(request_id="r2", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=2),
                              timeout_s=30)
        outs = []

        async def consume():
            async for out in orch.generate(req):
                outs.append(out)
        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(specs[1][2].added.wait, 10), "the stalling replica never got the input"
        topo.apply(TopologyEvent("UPDATED", [info(workers[1], "s1r0", "SUSPECT", stage_id=1)], 2))
        await asyncio.wait_for(task, 30)
        await orch.close()
        return outs, orch

    outs, orch = asyncio.run(go())
    # Stage 0 counted 11, 12; stage 1 (the replacement) continued from the last: 13, 14.
    assert [o.token_ids for o in outs if o.token_ids] == [[13], [14]] and outs[-1].finished
    assert orch.metrics.replays == {1: 1}
