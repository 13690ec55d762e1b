"""A replica marked SUSPECT while alive (missed heartbeats on a loaded host), done with a request whose next
stage still reads the tensors it published: the frontend keeps its channel open until that stage is done and
its FreeTensors went out, then closes it. A same-host stage frees everything it published to a frontend
whose channel closes, so closing at once let the slots be reused under the reader's zero-copy views."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from omni.master.types import TopologyEvent
from omni.orchestrator import executor
from omni.orchestrator.channel import BaseChannel
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.stage import messages as m
from tests.unit.test_orchestrator_core import ALL, CONFIG, chat, ids, ref


class Recording(BaseChannel):
    """A stage channel that keeps what is posted to it (the executor's StageChannel, without ZMQ)."""

    def __init__(self, _ctx, **kw):
        super().__init__(**kw)
        self.got: list = []
        self._decode = m.Codec(m.ToStage)

    def _transmit(self, frame: bytes) -> None:
        self.got.append(self._decode.decode(frame))

    def _close_carrier(self) -> None:
        pass


def running(before: int = 0):
    """Run r1 until the talker (s1r0) is done and code2wav (s2r0) holds its latents (shm keys 1, 2), after
    `before` text-only requests that stay in flight; yields (loop, orchestrator, topology) on a running loop."""
    async def start():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", list(ALL), 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda t: "".join(map(chr, t)),
                            choose_transport=lambda a, b, c: c or "shm")
        for i in range(before):
            orch._apply(orch.core.submit(chat(f"q{i}", modalities=("text",))))
        orch._apply(orch.core.submit(chat()))
        chs = orch._channels
        orch._on_stage_message(chs["s0r0"], m.Output(request_id="r1", token_ids=ids("Hi. Yo!"), finished=True))
        for erid, key in (("r1/s1", 1), ("r1/s2", 2)):
            orch._on_stage_message(chs["s1r0"], m.Output(request_id=erid, tensors={"latents": ref(key)},
                                                         finished=True))
        assert [type(x) for x in chs["s2r0"].got].count(m.AddRequest) == 3       # two latents, the final piece
        return orch, topo

    loop = asyncio.new_event_loop()
    orig = executor.StageChannel
    executor.StageChannel = Recording
    try:
        orch, topo = loop.run_until_complete(start())
        yield loop, orch, topo
        loop.run_until_complete(orch.close())
    finally:
        executor.StageChannel = orig
        loop.close()


@pytest.fixture
def talker_done():
    yield from running()


@pytest.fixture
def talker_done_among_many():
    yield from running(before=200)


def suspect(topo: Topology, replica_id: str, state: str = "SUSPECT", version: int = 2) -> None:
    r = topo.replicas[replica_id]
    topo.apply(TopologyEvent("UPDATED", [msgspec.structs.replace(r, state=state)], version))


def frees(ch: Recording) -> list[int]:
    return sorted(k for x in ch.got if isinstance(x, m.FreeTensors) for k in x.keys)


@pytest.mark.parametrize("state", ["SUSPECT", "DEAD"])
def test_a_gone_replica_whose_tensors_are_still_read_keeps_its_channel_until_they_are_freed(talker_done, state):
    loop, orch, topo = talker_done
    talker = orch._channels["s1r0"]
    suspect(topo, "s1r0", state)
    assert not talker.closed            # closed here before: the stage freed keys 1 and 2 under code2wav
    assert frees(talker) == []
    code2wav = orch._channels["s2r0"]
    orch._on_stage_message(code2wav, m.Output(request_id="r1", token_ids=[], finished=True))
    assert frees(talker) == [1, 2] and talker.closed and "s1r0" not in orch._channels


def test_a_suspect_replica_nothing_reads_from_is_closed_at_once(talker_done):
    loop, orch, topo = talker_done
    thinker = orch._channels["s0r0"]          # done, and the talker got text from it, no tensors
    suspect(topo, "s0r0")
    assert thinker.closed and "s0r0" not in orch._channels


def test_a_replica_back_to_ready_keeps_its_channel(talker_done):
    loop, orch, topo = talker_done
    talker = orch._channels["s1r0"]
    suspect(topo, "s1r0")
    suspect(topo, "s1r0", "READY", 3)
    orch._on_stage_message(orch._channels["s2r0"], m.Output(request_id="r1", token_ids=[], finished=True))
    assert frees(talker) == [1, 2] and not talker.closed and orch._channels["s1r0"] is talker


def test_a_removed_replica_or_one_restarted_under_its_id_is_closed_at_once(talker_done):
    """Its registration is gone (a restart under the id has other keys): no frees of the old one's go there."""
    loop, orch, topo = talker_done
    talker = orch._channels["s1r0"]
    topo.apply(TopologyEvent("REMOVED", [topo.replicas["s1r0"]], 2))
    assert talker.closed and "s1r0" not in orch._channels


def test_a_lingering_replica_back_as_another_process_is_closed(talker_done):
    loop, orch, topo = talker_done
    talker = orch._channels["s1r0"]
    suspect(topo, "s1r0")
    r = topo.replicas["s1r0"]
    topo.apply(TopologyEvent("UPDATED", [msgspec.structs.replace(r, state="READY", pid=2)], 3))
    assert talker.closed and "s1r0" not in orch._channels


def test_a_stage_message_checks_the_requests_that_read_a_lingering_replica_not_every_request(
        talker_done_among_many, monkeypatch):
    """While a gone replica's channel stayed open, each stage message looked for its tensors in every request in
    flight (500: 606 us a message, not 10, for up to request_timeout_s). Now the requests that read them are
    found once, when it goes, and a message checks those that still may: counted, not timed."""
    loop, orch, topo = talker_done_among_many
    talker, thinker = orch._channels["s1r0"], orch._channels["s0r0"]
    checked: list[str] = []
    real = executor.reads_from
    monkeypatch.setattr(executor, "reads_from", lambda state, rid: checked.append(state.rid) or real(state, rid))
    suspect(topo, "s1r0")
    assert not talker.closed and len(checked) <= 201 + 1        # the one look over all
    checked.clear()
    for k in range(100):
        orch._on_stage_message(thinker, m.Output(request_id=f"q{k}", token_ids=[97]))
    assert set(checked) == {"r1"} and len(checked) <= 100, len(checked)      # 100 x 201 before
    assert not talker.closed
    orch._on_stage_message(orch._channels["s2r0"], m.Output(request_id="r1", token_ids=[], finished=True))
    assert frees(talker) == [1, 2] and talker.closed


def test_a_request_a_lingering_replica_sends_to_is_watched(talker_done):
    """Should the core keep a tensor a gone replica sends after it went, its channel stays open for that reader."""
    loop, orch, topo = talker_done
    talker = orch._channels["s1r0"]
    suspect(topo, "s1r0")
    gone = orch._lingering["s1r0"]
    assert list(gone.readers) == ["r1"]
    gone.readers.clear()        # as if r1 read nothing of it then
    orch.core.handle = lambda event: []     # the core's answer does not matter here
    orch._on_stage_message(talker, m.Output(request_id="r1/s1", token_ids=[]))
    assert not talker.closed and list(gone.readers) == ["r1"]
