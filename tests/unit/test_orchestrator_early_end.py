"""The Orchestrator, stage channels in memory, the Qwen3-Omni shape (thinker -> talker -> code2wav):
a talker that ends its stream before the thinker finished (codec end, max_tokens) closes
code2wav's input at once, so the last audio does not wait for the thinker's whole text; the
chat's answer still has all of both, and the request ends cleanly (every tensor freed, nothing
aborted). An audio-only request then stops the thinker and ends with code2wav's last chunk."""

from __future__ import annotations

import asyncio

import pytest

from omni.engines.base import SamplingParams
from omni.master.types import TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.transport.base import TensorRef
from tests.unit.test_orchestrator_core import ALL
from tests.unit.test_orchestrator_fetch import WAIT_S, Consumer, FakeChannel, samples
from tests.unit.test_orchestrator_stream_end import Q3

pytestmark = pytest.mark.anyio


def make() -> tuple[Orchestrator, dict[str, FakeChannel]]:
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", list(ALL), 1))
    orch = Orchestrator(Q3, frontend_id="fe", topology=topo, detokenize=lambda ids: "", consumer=Consumer())
    channels = {r.replica_id: FakeChannel(r) for r in ALL}

    def channel(r):
        orch._channels[r.replica_id] = channels[r.replica_id]
        return channels[r.replica_id]
    orch._channel = channel
    return orch, channels


def shm(key: int, producer: str) -> TensorRef:
    return TensorRef(transport="shm", endpoint=f"seg-{producer}", key=key, dtype="float32", shape=(2,), nbytes=8)


def say(orch: Orchestrator, ch: FakeChannel, **kw) -> None:
    orch._on_stage_message(ch, m.Output(request_id="r1", **kw))


def adds(ch: FakeChannel) -> list[bool]:
    """`final` of each AddRequest the stage got."""
    return [msg.final for msg in ch.posted if isinstance(msg, m.AddRequest)]


async def run(modalities: tuple[str, ...]):
    orch, ch = make()
    thinker, talker, code2wav = ch["s0r0"], ch["s1r0"], ch["s2r0"]
    outs = []

    async def consume():
        async for out in orch.generate(PipelineRequest(request_id="r1", prompt_token_ids=[1, 2], voice="joe",
                                                       modalities=modalities, sampling=SamplingParams(max_tokens=8),
                                                       timeout_s=60)):
            outs.append(out)
    task = asyncio.create_task(consume())
    await thinker.until(lambda: adds(thinker) == [True])
    say(orch, thinker, token_ids=[5, 6], tensors={"prompt_token_ids": shm(3, "s0r0")})
    assert adds(talker) == [False]
    say(orch, talker, tensors={"codes": shm(1, "s1r0")})
    # The talker's codec end: it has said all it will while the thinker still writes.
    say(orch, talker, tensors={"codes": shm(2, "s1r0")}, finished=True, finish_reason="stop")
    return orch, (thinker, talker, code2wav), outs, task


async def test_a_talker_that_ends_before_the_thinker_closes_code2wavs_input_before_the_thinker_ends():
    orch, (thinker, talker, code2wav), outs, task = await run(("text", "audio"))
    try:
        assert adds(code2wav) == [False, False, True]        # closed now, not at the thinker's end
        assert not [msg for c in (thinker, talker) for msg in c.posted if isinstance(msg, m.Abort)]
        say(orch, code2wav, tensors={"audio": shm(9, "s2r0")}, sample_rate=24000, finished=True)
        await code2wav.until(lambda: 9 in code2wav.freed())
        say(orch, thinker, token_ids=[7])
        say(orch, thinker, token_ids=[8], finished=True, finish_reason="stop")
        await asyncio.wait_for(task, WAIT_S)
        assert adds(code2wav) == [False, False, True] and adds(talker) == [False]   # no piece after its end
        got = [(o.modality, o.token_ids, samples(o), o.finished) for o in outs]
        assert got == [("text", [5, 6], [], False), ("audio", [], [9.0, 9.0], False), ("text", [7], [], False),
                       ("text", [8], [], True)]
        assert outs[-1].finish_reason == "stop"
        assert 3 in thinker.freed() and {1, 2} <= set(talker.freed())
        assert not [msg for c in (thinker, talker, code2wav) for msg in c.posted if isinstance(msg, m.Abort)]
        assert orch.metrics.outcomes == {"ok": 1, "aborted": 0, "failed": 0}
        assert not orch._sinks and not orch.core.requests and not orch.core.by_replica
    finally:
        await orch.close()


async def test_an_audio_only_request_stops_the_thinker_and_ends_with_code2wavs_last_chunk():
    orch, (thinker, talker, code2wav), outs, task = await run(("audio",))
    try:
        assert adds(code2wav) == [False, False, True]
        assert [msg.request_ids for msg in thinker.posted if isinstance(msg, m.Abort)] == [["r1"]]
        say(orch, code2wav, tensors={"audio": shm(9, "s2r0")}, sample_rate=24000, finished=True)
        await asyncio.wait_for(task, WAIT_S)                  # the thinker never finished
        assert [(o.modality, o.finished) for o in outs] == [("text", False), ("audio", True)]   # text: the transcript
        say(orch, thinker, token_ids=[7], tensors={"h": shm(4, "s0r0")})   # sent before it took the Abort
        assert {3, 4} <= set(thinker.freed()) and {1, 2} <= set(talker.freed()) and 9 in code2wav.freed()
        assert orch.metrics.outcomes == {"ok": 1, "aborted": 0, "failed": 0}
        assert not orch._sinks and not orch.core.requests and not orch.core.by_replica
    finally:
        await orch.close()
