"""The text of a spoken answer, read as the chat route reads it (Generation) from the orchestrator
core, its stages played by a script: a stop string ends only the text stage, and the audio of
what it sent goes on; an audio-only answer carries its text as the transcript and in usage."""

from __future__ import annotations

import asyncio
from collections import deque

from omni.api.generation import Generation
from omni.api.metrics import FrontendMetrics
from omni.engines.base import SamplingParams
from omni.engines.logprobs import Logprobs
from omni.orchestrator import events as ev
from omni.orchestrator.types import PipelineRequest
from tests.unit.test_orchestrator_core import ALL, ids, make_core, output, ref


class Scripted:
    """OrchestratorLike over the core: the thinker's outputs come from a list, the talker answers
    each sentence with latents, code2wav each piece with audio."""

    def __init__(self, thinker: list[ev.StageOutput]):
        self.core = make_core(*ALL)
        self.thinker, self.replies, self.emits = deque(thinker), deque(), deque()
        self.aborted: list[ev.AbortStage] = []
        self.spoken: list[str] = []
        self.outcome = None
        self._key = 100

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, ev.Emit):
                if a.output.modality == "audio":
                    a.output.audio_pcm = b"\0" * 8
                self.emits.append(a.output)
            elif isinstance(a, ev.AbortStage):
                self.aborted.append(a)      # the thinker's outputs still come: sent before it took it
            elif isinstance(a, ev.Finished):
                self.outcome = a.outcome
            elif isinstance(a, ev.Send):
                self._key += 1
                msg = a.message
                if a.replica.replica_id == "s1r0":
                    self.spoken.append(msg.text)
                    self.replies.append(output("s1r0", 1, msg.request_id, tensors={"latents": ref(self._key)},
                                               finished=True))
                elif msg.tensors:
                    self.replies.append(output("s2r0", 2, msg.request_id, tensors={"audio": ref(self._key, "s2r0")},
                                               sample_rate=24000))
                if a.replica.replica_id == "s2r0" and msg.final:
                    self.replies.append(output("s2r0", 2, msg.request_id, finished=True))

    async def generate(self, req):
        self._apply(self.core.submit(req))
        while True:
            while self.emits:
                o = self.emits.popleft()
                yield o
                if o.finished:
                    return
            assert self.replies or self.thinker, "the request stalled"
            self._apply(self.core.handle((self.replies or self.thinker).popleft()))

    def end_text(self, request_id: str) -> None:
        self._apply(self.core.handle(ev.EndText(request_id)))


def thinker_says(*pieces: str, logprobs: bool = False) -> list[ev.StageOutput]:
    outs = []
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        lp = Logprobs(sampled=[-1.0] * len(p), top_ids=[[c] for c in ids(p)], top=[[-1.0]] * len(p)) if logprobs else None
        outs.append(output("s0r0", 0, "r1", token_ids=ids(p), logprobs=lp, finished=last,
                           finish_reason="length" if last else None))
    return outs


def answer(orch: Scripted, modalities, stops=()) -> tuple[Generation, list]:
    req = PipelineRequest(request_id="r1", prompt_token_ids=[1, 2], modalities=modalities, voice="joe",
                          sampling=SamplingParams(max_tokens=64, logprobs=0))
    gen = Generation(orch, req, decode=lambda t: "".join(map(chr, t)), prompt_ids=[1, 2], stops=list(stops),
                     metrics=FrontendMetrics(), route="/v1/chat/completions", t0=0.0)

    async def run():
        await gen.start()
        return [e async for e in gen.events()]
    return gen, asyncio.run(run())


def test_a_stop_string_ends_the_text_and_the_audio_of_what_was_sent_goes_on():
    orch = Scripted(thinker_says("Hi. Are you", " there? Fine. Bye.", " More."))
    gen, events = answer(orch, ("text", "audio"), stops=["you"])
    assert (gen.text, gen.finish_reason, gen.stop_reason) == ("Hi. Are ", "stop", "you")
    assert gen.completion_tokens == len("Hi. Are you")
    kinds = [e[0] for e in events]
    assert kinds.count("audio") == 2 and kinds[-1] == "end"
    # The thinker is aborted at the stop; its held sentence is spoken, nothing it sent after it.
    assert [a.request_ids for a in orch.aborted if a.replica_id == "s0r0"] == [("r1",)]
    assert orch.spoken == ["Hi.", "Are you"] and orch.outcome == "ok"
    assert "".join(e[1] for e in events if e[0] != "audio") == "Hi. Are "
    assert gen.sample_rate == 24000


def test_an_audio_only_answer_counts_its_text_and_carries_it_as_the_transcript():
    orch = Scripted(thinker_says("Hi. Yo", "!", logprobs=True))
    gen, events = answer(orch, ("audio",))
    assert gen.text == "Hi. Yo!" and gen.completion_tokens == 7 and len(gen.take_logprobs()) == 7
    assert [e[0] for e in events] == ["audio", "audio", "end"] and events[-1][1] == ""   # no text events
    assert gen.usage()["completion_tokens"] == 7 and orch.outcome == "ok"


def test_an_audio_only_answer_honours_a_stop_string():
    orch = Scripted(thinker_says("Hi. Are you", " there? Fine."))
    gen, events = answer(orch, ("audio",), stops=["you"])
    assert (gen.text, gen.stop_reason, gen.completion_tokens) == ("Hi. Are ", "you", len("Hi. Are you"))
    assert orch.spoken == ["Hi.", "Are you"] and [e[0] for e in events] == ["audio", "audio", "end"]
