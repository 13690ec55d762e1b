"""A stop string in a chat with audio (EndText) stops the thinker, but the hidden states it already
sent the talker stay readable until the talker is done with them: the orchestrator core and a real
stage worker with a real shared-memory producer, the Abort going between them as the executor sends it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni.config import StageConfig, parse
from omni.engines.base import Engine, EngineOutput, SamplingParams
from omni.orchestrator import events as ev
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.base import TransportError
from omni.transport.shm import ShmConsumer, ShmProducer
from tests.unit.test_orchestrator_core import make_core, of, replica

# Qwen2.5-Omni's shape: every thinker piece carries its hidden rows to the talker.
CFG = parse({"model": "m", "stages": [
    {"stage_id": 0, "name": "thinker", "engine": "count", "final_output": True, "final_output_type": "text"},
    {"stage_id": 1, "name": "talker", "engine": "count", "inputs": [0],
     "processor": "omni.models.qwen25_omni.processors:thinker_to_talker"},
    {"stage_id": 2, "name": "token2wav", "engine": "count", "inputs": [1],
     "processor": "omni.models.qwen25_omni.processors:talker_to_token2wav", "final_output": True,
     "final_output_type": "audio"}]}, source="test")


class Thinker(Engine):
    """Each step: one more token per request, with its hidden row (the token's value) as a tensor."""

    def __init__(self):
        self.reqs: dict[str, int] = {}

    def add_request(self, r):
        self.reqs[r.request_id] = 0

    def abort(self, rid):
        self.reqs.pop(rid, None)

    def step(self):
        out = []
        for rid in self.reqs:
            self.reqs[rid] += 1
            n = self.reqs[rid]
            out.append(EngineOutput(request_id=rid, token_ids=[64 + n],
                                    tensors={"thinker_hidden": torch.full((4,), float(n))}))
        return out

    def has_unfinished(self):
        return bool(self.reqs)


@pytest.fixture
def thinker():
    producer = ShmProducer(arena_bytes=1 << 20, max_segments=1)
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), Thinker(),
                    make_producer=lambda kind: producer, replica_id="s0r0")
    w._frontends.add(b"fe")
    frames: list[bytes] = []
    w._send_frame = lambda ident, frame: frames.append(frame) or True
    consumer = ShmConsumer()
    yield w, producer, consumer, frames
    consumer.close()
    w.close()


def to_worker(w: StageWorker, actions) -> None:
    """Carry out the actions for replica s0r0 as the executor does (its own Abort message included)."""
    posted = []
    ch = SimpleNamespace(post=posted.append)
    fake = SimpleNamespace(_live_channel=lambda rid: ch if rid == "s0r0" else None,
                           _fetch=SimpleNamespace(hold=lambda rid, transport, keys, ch, incarnation="": keys))
    for a in actions:
        if isinstance(a, ev.AbortStage):
            Orchestrator._do_abort(fake, a)
        elif isinstance(a, ev.Free):
            Orchestrator._do_free(fake, a)
    for msg in posted:
        w._handle(b"fe", msg)


def test_end_text_abort_keeps_published_and_the_talker_end_frees_them(thinker):
    w, producer, consumer, frames = thinker
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "s2r0"), config=CFG)
    acts = core.submit(PipelineRequest(request_id="r1", prompt_token_ids=[1, 2], modalities=("text", "audio"),
                                       sampling=SamplingParams(max_tokens=64)))
    w._handle(b"fe", of(acts, ev.Send)[0].message)
    w._step()
    w._step()
    codec = m.frontend_codec()
    to_talker = []
    for frame in frames:
        acts = core.handle(ev.StageOutput("s0r0", 0, codec.decode(frame)))
        to_talker += [r for a in of(acts, ev.Send) for r in a.message.tensors.values()]
    frames.clear()
    end = core.handle(ev.EndText("r1"))
    assert of(end, ev.AbortStage) == [ev.AbortStage("s0r0", ("r1",), keep_published=True)]
    assert not of(end, ev.Free)      # the talker holds them
    to_talker += [r for a in of(end, ev.Send) for r in a.message.tensors.values()]
    to_worker(w, end)
    assert "r1" not in w._reqs and not w.engine.reqs      # the thinker stopped
    w._step()
    assert not frames                                     # and makes nothing more
    # The talker reads every hidden row it was sent, after the thinker took the Abort.
    assert len(to_talker) == 2
    assert [consumer.get(r).tolist() for r in to_talker] == [[1.0] * 4, [2.0] * 4]
    # The talker ends: its inputs are freed at the thinker, which then holds nothing of the request.
    done = core.handle(ev.StageOutput("s1r0", 1, m.Output(request_id="r1", finished=True)))
    assert of(done, ev.Free)
    to_worker(w, done)
    assert producer.bytes_in_use() == 0 and len(w._published) == 0
    with pytest.raises(TransportError):
        consumer.get(to_talker[0])


def test_an_abort_of_a_failed_request_still_frees_what_it_published(thinker):
    w, producer, consumer, frames = thinker
    w._handle(b"fe", m.AddRequest(request_id="r1", prompt_token_ids=[1], out_transport="shm", out_tensors=True))
    w._step()
    assert producer.bytes_in_use() > 0
    w._handle(b"fe", m.Abort(["r1"]))
    assert producer.bytes_in_use() == 0 and len(w._published) == 0
