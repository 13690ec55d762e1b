"""A talker slot whose cache is full while its request waits for text: the other slots keep
stepping (the full row's rotary position is read too, and must stay in bounds), and the full
request ends 'length' with its codes exact."""

from __future__ import annotations

import pytest
import torch

from tests.unit.qwen3_ref import drive, talker_pieces
from tests.unit.test_qwen3_talker import folder, ref  # noqa: F401 (the tiny model and its reference, shared)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

TOKENS = 24
ROOM = 3        # decode frames that fit after the prefill


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)


def test_a_full_waiting_slot_does_not_break_the_others(folder, ref):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    run = ref.run("What is the capital of France?", "Ethan", talker_tokens=TOKENS)
    probe = Qwen3TalkerEngine(folder, max_num_seqs=1)
    drive(probe, {"p": talker_pieces(run, "p", "ethan", False, 2)})
    prefill = int(probe.stats()["prefill_tokens"])
    engine = Qwen3TalkerEngine(folder, max_model_len=prefill + ROOM, max_num_seqs=4)
    streamed = talker_pieces(run, "a", "ethan", True, TOKENS)
    assert len(streamed) > ROOM + 2
    # "a" streams its text one piece a step and fills its cache, then waits (None) while "b",
    # admitted two steps later, decodes past that point.
    feeds = {"a": streamed[:ROOM + 1] + [None] * 6 + streamed[ROOM + 1:],
             "b": [None, None] + talker_pieces(run, "b", "ethan", False, TOKENS)}
    outs = drive(engine, feeds)
    frames = ROOM + 1           # one from the prefill, then one per cache row after it
    for rid in ("a", "b"):
        assert outs[rid][-1].finish_reason == "length", (rid, outs[rid][-1])
        assert torch.equal(_codes(outs[rid]), run.codes[:, :frames]), rid


def test_a_failed_graph_capture_leaves_the_talker_serving(folder, ref, gpu, monkeypatch, caplog):
    """A capture that fails part way (out of memory, a kernel that refuses capture) leaves the talker on
    its eager static frame, logged, with the same codes, instead of failing the stage."""
    from omni.models.qwen3_omni.graphs import FrameGraphs
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    run = ref.run("What is the capital of France?", "Ethan", talker_tokens=TOKENS)
    capture, calls = FrameGraphs._capture, []

    def fails_second(fn, n, pool):
        calls.append(n)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return capture(fn, n, pool)

    monkeypatch.setattr(FrameGraphs, "_capture", staticmethod(fails_second))
    engine = Qwen3TalkerEngine(folder, device="cuda", dtype="float32", max_num_seqs=4)
    assert len(calls) == 2 and engine._static.graphs is None
    assert "CUDA graph capture failed (CUDA out of memory. Tried to allocate 2.00 GiB)" in caplog.text
    out = drive(engine, {"a": talker_pieces(run, "a", "ethan", True, TOKENS)})["a"]
    assert torch.equal(_codes(out), run.codes)
