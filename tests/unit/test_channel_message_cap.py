"""An AddRequest over the stage channel's 64 MiB message cap (a request's inline audio: every WAV part
becomes 16 kHz float32, so a small body of 8-bit 1 kHz WAV decodes 64 times larger). Sent over ZMQ, the
stage's ROUTER dropped the whole connection: that request and every other one on the link waited for
request_timeout_s. It is refused before it is sent, as that request's client error only."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni.engines.base import SamplingParams
from omni.errors import CLIENT, BadRequest
from omni.master.types import TopologyEvent
from omni.orchestrator import limits
from omni.orchestrator.channel import BaseChannel
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.stage.curve import MAX_MESSAGE_BYTES
from omni.stage.messages import InlineTensor
from tests.unit.test_orchestrator_replay import CONFIG, info, running  # noqa: F401 (fixture)
from tests.unit.test_stage_worker import CountEngine


class SlowCount(CountEngine):
    def step(self):
        time.sleep(0.02)    # a request stays in flight while the big one is posted
        return super().step()


def over_cap() -> dict[str, InlineTensor]:
    n = MAX_MESSAGE_BYTES // 4 + 1
    return {"audio_0": InlineTensor("float32", (n,), bytes(4 * n))}


async def collect(orch: Orchestrator, req: PipelineRequest) -> tuple[int, BaseException | None, float]:
    t0, n = time.monotonic(), 0
    try:
        async for _ in orch.generate(req):
            n += 1
    except Exception as e:
        return n, e, time.monotonic() - t0
    return n, None, time.monotonic() - t0


def test_a_message_over_the_cap_fails_its_request_only_and_the_link_lives_on(running, monkeypatch):  # noqa: F811
    monkeypatch.setattr(limits, "MAX_INLINE_BYTES", 1 << 40, raising=False)   # past the frontend's own check: the channel's
    [w] = running(CONFIG, [(0, "s0r0", SlowCount())])

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [info(w, "s0r0")], 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-cap", topology=topo, detokenize=lambda ids: "")
        try:
            def req(rid, **kw):
                return PipelineRequest(request_id=rid, prompt_token_ids=[10], timeout_s=8, **kw)
            small = asyncio.create_task(collect(orch, req("small", sampling=SamplingParams(max_tokens=40))))
            await asyncio.sleep(0.3)
            big = await collect(orch, req("big", sampling=SamplingParams(max_tokens=3), inputs=over_cap()))
            after = await collect(orch, req("after", sampling=SamplingParams(max_tokens=3)))
            return await small, big, after
        finally:
            await orch.close()

    small, big, after = asyncio.run(go())
    n, err, took = big
    assert isinstance(err, BadRequest) and err.kind == CLIENT and took < 2, (err, took)   # RequestTimeout at 8 s before
    assert "message cap" in str(err) and str(MAX_MESSAGE_BYTES) in str(err)
    assert small[:2] == (40, None) and after[:2] == (3, None), (small, after)


def test_inline_inputs_past_what_the_channel_carries_are_a_400_before_anything_is_sent():
    async def go():
        orch = Orchestrator(CONFIG, frontend_id="fe-cap", topology=Topology(), detokenize=lambda ids: "")
        try:
            req = PipelineRequest(request_id="big", prompt_token_ids=[10], inputs=over_cap())
            return await collect(orch, req), orch.in_flight
        finally:
            await orch.close()

    (_, err, _), in_flight = asyncio.run(go())
    assert isinstance(err, BadRequest) and str(limits.MAX_INLINE_BYTES) in str(err) and "audio_0" in str(err)
    assert in_flight == 0 and limits.MAX_INLINE_BYTES <= MAX_MESSAGE_BYTES - (1 << 20)


def test_the_channel_never_transmits_a_frame_over_the_cap():
    class Recording(BaseChannel):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.sent: list[int] = []

        def _transmit(self, frame: bytes) -> None:
            self.sent.append(len(frame))

    async def go():
        ch = Recording(frontend_id="fe", replica_id="s0r0", stage_id=0, endpoint="", token="",
                       on_message=lambda *a: None)
        with pytest.raises(BadRequest, match="AddRequest of .* bytes is over the stage channel"):
            ch.post(m.AddRequest(request_id="r", inline=over_cap()))
        ch.post(m.Abort(["r"]))         # the channel goes on
        return ch.sent

    sent = asyncio.run(go())
    assert len(sent) == 1 and sent[0] < 1024
