"""Stop strings and stop tokens as vLLM applies them: Generation (the HTTP routes' reading of a
request's outputs) against vLLM's own detokenizer (BaseIncrementalDetokenizer.update and the
output processor's token trim) on the same outputs, one character per token id."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from omni.api.generation import Generation
from omni.api.metrics import FrontendMetrics
from omni.engines.logprobs import Logprobs
from omni.engines.base import SamplingParams
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from tests.unit.test_stop_token_text import Replay

vdetok = pytest.importorskip("vllm.v1.engine.detokenizer")


class CharDetokenizer(vdetok.BaseIncrementalDetokenizer):
    def decode_next(self, next_token_id: int) -> str:
        return chr(next_token_id)


def vllm_reads(chunks: list[list[int]], stop_token: int | None, stops: list[str], include: bool,
               min_tokens: int) -> tuple:
    """(text, completion tokens, stop_reason) as vLLM's engine ends a request of these outputs."""
    params = SimpleNamespace(stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include)
    d = CharDetokenizer(SimpleNamespace(sampling_params=params))
    reason = None
    for k, ids in enumerate(chunks):
        last = k == len(chunks) - 1
        stop_str = d.update(list(ids), last and stop_token is not None)
        if stop_str is not None:
            return d.output_text, d.num_output_tokens(), stop_str
        if last and stop_token is not None:
            reason = stop_token
    return d.output_text, d.num_output_tokens(), reason


def omni_reads(chunks, stop_token, stops, include, min_tokens) -> tuple:
    outs = []
    for k, ids in enumerate(chunks):
        last = k == len(chunks) - 1
        lp = Logprobs(sampled=[-1.0] * len(ids), top_ids=[[i] for i in ids], top=[[-1.0] for _ in ids])
        outs.append(PipelineOutput(request_id="r", stage_id=0, modality="text", token_ids=list(ids), logprobs=lp,
                                   finished=last, finish_reason="stop" if last and stop_token else
                                   ("length" if last else None), stop_reason=stop_token if last else None))
    req = PipelineRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(min_tokens=min_tokens,
                                                                                          logprobs=0))
    gen = Generation(Replay(outs), req, decode=lambda t: "".join(map(chr, t)), prompt_ids=[1], stops=stops,
                     include_stop=include, metrics=FrontendMetrics(), route="/v1/completions", t0=0.0)

    async def run():
        await gen.start()
        return [e async for e in gen.events()]
    asyncio.run(run())
    assert len(gen.take_logprobs()) == gen.completion_tokens    # logprobs trimmed with the tokens
    return gen.text, gen.completion_tokens, gen.stop_reason


def ids(s: str) -> list[int]:
    return [ord(c) for c in s]


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_string_that_ends_first_wins_and_later_tokens_do_not_count(include):
    # one piece "\n\n" completes both; vLLM takes "\n" (it ends first), the text stops there
    case = ([ids("a"), ids("\n\n")], None, ["\n\n", "\n"], include, 0)
    assert omni_reads(*case) == vllm_reads(*case) == ("a\n" if include else "a", 2, "\n")
    # "xyz" in one output: tokens after the one that completes the stop are not counted
    case = ([ids("Hi xyz")], None, ["x"], include, 0)
    assert omni_reads(*case) == vllm_reads(*case) == ("Hi x" if include else "Hi ", 4, "x")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_adds_its_text_only_with_include_stop_str_in_output(include):
    case = ([ids("The capital is Paris.")], ord("."), [], include, 0)
    assert omni_reads(*case) == vllm_reads(*case) == (
        "The capital is Paris." if include else "The capital is Paris", 21, ord("."))


def test_random_outputs_end_as_vllm_ends_them():
    rng = random.Random(7)
    alphabet = "ab\n. "
    for n in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(4, len(text) - 1)))) if len(text) > 1 else []
        chunks = [ids(text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)])]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        stop_token = ord(text[-1]) if rng.random() < 0.3 else None
        case = (chunks, stop_token, stops, rng.random() < 0.5, rng.randint(0, 4))
        assert omni_reads(*case) == vllm_reads(*case), (n, case)
