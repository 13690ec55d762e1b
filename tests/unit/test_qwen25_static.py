"""Qwen2.5-Omni's talker on the static step (tiny model, float32): codes equal the eager path's (and
transformers' where greedy) under churn and sampling, slots reused, one host read per step."""

from __future__ import annotations

import pytest
import torch

from tests.unit.host_reads import HostReads
from tests.unit.qwen25_ref import talker_pieces
from tests.unit.qwen3_ref import drive
from tests.unit.test_qwen25_omni import TALKER_TOKENS, france, folder, ref, sea  # noqa: F401 (shared fixtures)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)[0]


@pytest.fixture(scope="module")
def engines(folder):
    from omni.models.qwen25_omni.talker import Qwen25TalkerEngine

    return Qwen25TalkerEngine(folder, max_num_seqs=3), Qwen25TalkerEngine(folder, static_decode=False)


def test_static_equals_eager_under_churn(engines, france, sea):
    """Per-piece and gappy feeds, a late joiner, seeded sampled requests and more requests than the 3
    slots: every request's codes equal the eager path's, the greedy ones transformers'."""
    static, eager = engines

    def feeds():
        gappy = [x for p in talker_pieces(sea, "b", "ethan", True, TALKER_TOKENS - 9) for x in (p, None)]
        return {"a": talker_pieces(france, "a", "chelsie", True, TALKER_TOKENS),
                "b": gappy,
                "c": [None] * 4 + talker_pieces(france, "c", "chelsie", False, 12),
                "s1": talker_pieces(france, "s1", "chelsie", True, 20, temperature=0.9, top_k=40, top_p=0.8, seed=4),
                "s2": [None] * 2 + talker_pieces(sea, "s2", "ethan", False, 20, temperature=0.7, seed=5)}

    got, want = drive(static, feeds()), drive(eager, feeds())
    for rid in got:
        assert torch.equal(_codes(got[rid]), _codes(want[rid])), rid
        assert got[rid][-1].finish_reason == want[rid][-1].finish_reason, rid
    assert torch.equal(_codes(got["a"]), france.codes) and torch.equal(_codes(got["b"]), sea.codes)
    assert torch.equal(_codes(got["c"]), france.codes[:12]) and got["c"][-1].finish_reason == "length"
    assert static.stats()["slot_moves"] > 0 and not static.has_open_streams() and static._static.owner == []


def test_one_host_read_per_step(engines, france, sea):
    static, _ = engines
    for rid, run, voice in (("h1", france, "chelsie"), ("h2", sea, "ethan")):
        for piece in talker_pieces(run, rid, voice, False, 10, temperature=0.9, seed=1):
            static.add_request(piece)
    counts = []
    while static.has_unfinished():
        with HostReads() as reads:
            static.step()
        counts.append(len(reads))
    assert len(counts) >= 9 and max(counts) <= 1, counts


def test_sleep_cycle_rebuilds_the_static_state(folder, france):
    """Sleep drops the static state, wake-up builds it again, the codes stay transformers'."""
    from omni.models.qwen25_omni.talker import Qwen25TalkerEngine

    engine = Qwen25TalkerEngine(folder, max_num_seqs=2)
    old = engine._static
    engine.offload._off()         # what sleep does once it is allowed (a GPU); CPU refuses sleep itself
    assert engine._static is None
    engine.offload._on()
    assert engine._static is not None and engine._static is not old
    got = drive(engine, {"a": talker_pieces(france, "a", "chelsie", True, TALKER_TOKENS)})["a"]
    assert torch.equal(_codes(got), france.codes)


@pytest.mark.parametrize("path", ["static", "eager"])
def test_a_stream_ended_short_of_rows_after_prefill_is_an_error(engines, france, path):
    """The final piece came after the prefill but the rows of generated ids 1.. never did: the request ends
    with an error naming the rows (its slot freed), as the same shortage before the prefill does; it hung
    open (not ready, never stepped) until request_timeout_s."""
    from omni.engines.base import EngineRequest, SamplingParams

    engine = engines[0] if path == "static" else engines[1]
    n = len(france.prompt)
    gen = france.generated
    assert len(gen) > 3
    engine.add_request(EngineRequest(request_id="short", prompt_token_ids=france.prompt, voice="chelsie",
                                     tensors={"thinker_hidden": france.hidden[:n + 1]}, generated_ids=gen[:2],
                                     final=False, sampling=SamplingParams(max_tokens=50)))
    outs = list(engine.step())         # the prefill (and its first code)
    assert engine.has_open_streams()
    engine.add_request(EngineRequest(request_id="short", generated_ids=gen[2:], final=True))
    assert engine.has_unfinished()     # the worker steps it: a step ends it
    for _ in range(10):
        outs += engine.step()
        if outs and outs[-1].finished:
            break
    last = outs[-1]
    assert last.finished and last.finish_reason == "error", outs
    assert f"ended with {n + 1} thinker_hidden row(s)" in last.error and f"needs {n + 2}" in last.error
    assert not engine.has_open_streams() and (engine._static is None or engine._static.owner == [])
