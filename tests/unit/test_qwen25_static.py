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
