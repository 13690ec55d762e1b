"""A consumer cancelled (a client's disconnect) just as an output lands: the cancel must end
the stream, not be dropped with the output handed back (3.11's asyncio.wait_for did that,
and a disconnected request then ran to max_tokens). Real StageWorker on a real socket."""

from __future__ import annotations

import asyncio

import pytest

from omni.engines.base import SamplingParams
from omni.master.types import TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from tests.unit.test_orchestrator_replay import CONFIG, StallEngine, info, running  # noqa: F401 (fixture)


@pytest.mark.parametrize("turns", range(4))
def test_a_cancel_that_lands_with_an_output_ends_the_stream(running, turns):  # noqa: F811
    [worker] = running(CONFIG, [(0, "s0r0", StallEngine(0))])   # takes the request, never answers

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [info(worker, "s0r0")], 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "")
        req = PipelineRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=9),
                              timeout_s=60)
        got = []

        async def consume():
            async for out in orch.generate(req):
                got.append(out)

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(worker.engine.added.wait, 10), "the replica never got the request"
        orch._sinks["r1"].queue.put_nowait(PipelineOutput(request_id="r1", stage_id=0, modality="text",
                                                          token_ids=[11]))
        for _ in range(turns):   # where the cancel lands relative to the output's wake-up
            await asyncio.sleep(0)
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)   # a dropped cancel: the consumer waits on, TimeoutError
            assert "r1" not in orch._sinks
        finally:
            await orch.close()

    asyncio.run(go())
