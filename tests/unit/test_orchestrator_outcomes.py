"""The Orchestrator as the HTTP routes drive it (through api.generation.Generation), with
in-memory channels: a completed request counts as ok and sends no Abort, a client that
leaves counts as aborted, a stage error as failed (issue 16: every success was counted as
failed and aborted in every stage)."""

from __future__ import annotations

import asyncio

import pytest

from omni.api.generation import Generation
from omni.api.metrics import FrontendMetrics
from omni.config import parse
from omni.engines.base import SamplingParams
from omni.errors import RequestTimeout, StageFailed
from omni.master.types import TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from tests.unit.test_orchestrator_core import replica

pytestmark = pytest.mark.anyio

CONFIG = parse({"model": "m", "stages": [{"stage_id": 0, "engine": "count", "final_output": True,
                                          "final_output_type": "text"}]}, source="test")


class FakeChannel:
    kind = "zmq"

    def __init__(self, r):
        self.replica_id, self.stage_id, self.closed = r.replica_id, r.stage_id, False
        self.posted: list = []
        self.added = asyncio.Event()

    def post(self, msg) -> None:
        self.posted.append(msg)
        if isinstance(msg, m.AddRequest):
            self.added.set()

    def close(self) -> None:
        self.closed = True


def make() -> tuple[Orchestrator, FakeChannel]:
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", [replica(0, "s0r0")], 1))
    orch = Orchestrator(CONFIG, frontend_id="fe", topology=topo, detokenize=lambda ids: "")
    ch = FakeChannel(replica(0, "s0r0"))

    def channel(r):
        orch._channels[r.replica_id] = ch
        return ch
    orch._channel = channel
    return orch, ch


def generation(orch: Orchestrator, rid: str, timeout_s: float | None = None) -> Generation:
    req = PipelineRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=2),
                          timeout_s=timeout_s)
    return Generation(orch, req, decode=lambda ids: "".join(chr(96 + i) for i in ids), prompt_ids=[],
                      stops=[], metrics=FrontendMetrics(), route="/v1/completions", t0=0.0)


def aborts(ch: FakeChannel) -> list:
    return [msg.request_ids for msg in ch.posted if isinstance(msg, m.Abort)]


async def test_a_completed_request_is_ok_and_nothing_is_aborted():
    orch, ch = make()
    gen = generation(orch, "r1")
    start = asyncio.create_task(gen.start())
    await asyncio.wait_for(ch.added.wait(), 5)
    orch._on_stage_message(ch, m.Output(request_id="r1", token_ids=[1]))
    orch._on_stage_message(ch, m.Output(request_id="r1", token_ids=[2], finished=True, finish_reason="length"))
    await asyncio.wait_for(start, 5)
    texts = [e[1] async for e in gen.events()]       # closes the iterator on the final item
    assert "".join(texts) == "ab" and gen.finish_reason == "length" and gen.stop_reason is None
    assert aborts(ch) == []
    assert orch.metrics.outcomes == {"ok": 1, "aborted": 0, "failed": 0}
    assert 'omni_pipeline_requests_total{frontend="fe",outcome="ok"} 1' in orch.metrics_text()
    assert 'omni_frontend_in_flight{frontend="fe"} 0' in orch.metrics_text()
    await orch.close()


async def test_a_client_that_leaves_aborts_the_request():
    orch, ch = make()
    gen = generation(orch, "r2")
    start = asyncio.create_task(gen.start())
    await asyncio.wait_for(ch.added.wait(), 5)
    orch._on_stage_message(ch, m.Output(request_id="r2", token_ids=[1]))
    await asyncio.wait_for(start, 5)
    await gen.close()
    assert aborts(ch) == [["r2"]]
    assert orch.metrics.outcomes == {"ok": 0, "aborted": 1, "failed": 0}
    # Its late output is only freed.
    orch._on_stage_message(ch, m.Output(request_id="r2", token_ids=[2], finished=True))
    assert orch.metrics.outcomes["ok"] == 0 and orch.in_flight == 0
    await orch.close()


async def test_a_stage_error_fails_the_request_with_its_kind():
    orch, ch = make()
    gen = generation(orch, "r3")
    start = asyncio.create_task(gen.start())
    await asyncio.wait_for(ch.added.wait(), 5)
    orch._on_stage_message(ch, m.RequestError("r3", "max_tokens too large", 0, "s0r0", kind="client"))
    with pytest.raises(StageFailed, match="max_tokens too large") as e:
        await asyncio.wait_for(start, 5)
    assert e.value.kind == "client"
    assert orch.metrics.outcomes == {"ok": 0, "aborted": 0, "failed": 1}
    await orch.close()


async def test_a_request_past_its_deadline_times_out_and_is_aborted():
    orch, ch = make()
    gen = generation(orch, "r4", timeout_s=0.2)
    with pytest.raises(RequestTimeout, match="r4 timed out"):
        await asyncio.wait_for(gen.start(), 10)
    assert aborts(ch) == [["r4"]]
    assert orch.metrics.outcomes == {"ok": 0, "aborted": 0, "failed": 1}
    await orch.close()
