"""The token a stop finish stopped on adds no text, whether audio follows the text or not:
the core's outputs for one thinker answer, read as the HTTP routes read them (Generation)."""

from __future__ import annotations

import asyncio

from omni.api.generation import Generation
from omni.api.metrics import FrontendMetrics
from omni.orchestrator import events as ev
from tests.unit.test_orchestrator_core import ALL, chat, ids, make_core, of, output, ref

STOP = ord("~")


def emitted(modalities) -> list:
    """What the core emits for the thinker's "Hi~" (stopped on "~"), audio read in as the executor does."""
    core = make_core(*ALL)
    core.submit(chat(modalities=modalities))
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi~"), finished=True, finish_reason="stop",
                              stop_reason=STOP))
    if "audio" in modalities:
        acts += core.handle(output("s1r0", 1, "r1/s1", tensors={"latents": ref(1)}, finished=True))
        acts += core.handle(output("s2r0", 2, "r1", tensors={"audio": ref(2, "s2r0")}, sample_rate=24000,
                                   finished=True))
    outs = [a.output for a in of(acts, ev.Emit)]
    for o in outs:
        if o.modality == "audio":
            o.audio_pcm = b"\0" * 8
    return outs


class Replay:
    def __init__(self, outs):
        self.outs = outs

    async def generate(self, req):
        for o in self.outs:
            yield o


def content(outs) -> tuple:
    req = chat()
    gen = Generation(Replay(outs), req, decode=lambda t: "".join(map(chr, t)), prompt_ids=[1, 2], stops=[],
                     metrics=FrontendMetrics(), route="/v1/chat/completions", t0=0.0)

    async def run():
        await gen.start()
        return [e async for e in gen.events()]
    asyncio.run(run())
    return gen.text, gen.finish_reason, gen.stop_reason


def test_the_stop_token_adds_no_text_when_audio_follows_the_text():
    with_audio = emitted(("text", "audio"))
    assert [o.modality for o in with_audio] == ["text", "audio"] and with_audio[-1].finished
    assert content(emitted(("text",))) == content(with_audio) == ("Hi", "stop", STOP)
