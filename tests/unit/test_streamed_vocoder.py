"""The streamed vocoder base with an in-memory vocoder: each code becomes HOP samples of its value."""

from __future__ import annotations

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest
from omni.engines.offload import IdleOffload
from omni.engines.streamed_vocoder import StreamedVocoder, Window
from tests.unit.qwen3_ref import drive

HOP = 3


class Echo(StreamedVocoder):
    name = "echo"

    def __init__(self, chunk=4, context=2, **kw):
        super().__init__(device="cpu", groups=1, vocab=100, sample_rate=HOP, **kw)
        self.chunk, self.context, self.fail, self.batches, self.moved = chunk, context, set(), [], []

    def ready(self, s):
        return s.final or s.total - s.done >= self.chunk

    def keep_from(self, s):
        return max(0, s.done - self.context)

    def window(self, s):
        lo, end = self.keep_from(s), min(s.total, s.done + self.chunk)
        return Window(lo, end, end, key=(end - lo,))

    def decode(self, batch):
        self.batches.append([s.rid for s, _ in batch])
        if self.fail & {s.rid for s, _ in batch}:
            raise RuntimeError("boom")
        return [s.codes(w.lo, w.hi)[0].float().repeat_interleave(HOP)[s.samples - w.lo * HOP:] for s, w in batch]

    def move_to(self, device):
        self.moved.append(device.type)


def _pieces(rid, codes, sizes):
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(EngineRequest(request_id=rid, tensors={"codes": codes[at:at + n]},
                                 final=i == len(sizes) - 1))
        at += n
    return out


def _audio(outs):
    return torch.cat([o.tensors["audio"] for o in outs])


def test_streams_are_joined_batched_and_round_robin():
    e = Echo(max_num_seqs=2)
    codes = torch.arange(10)
    outs = drive(e, {r: _pieces(r, codes, [5, 5]) for r in "abc"})
    for r in "abc":
        assert torch.equal(_audio(outs[r]), codes.float().repeat_interleave(HOP))
        assert outs[r][-1].finished and outs[r][-1].sample_rate == HOP
    assert max(len(b) for b in e.batches) == 2 and e.stats()["batched"] > 0
    assert {r for b in e.batches for r in b} == set("abc") and not e.has_open_streams()
    assert e.stats()["rtf"] > 0 and e.stats()["samples"] == 3 * 10 * HOP


def test_a_failed_decode_fails_only_its_batch():
    e = Echo(max_num_seqs=1)
    e.fail = {"bad"}
    outs = drive(e, {"bad": _pieces("bad", torch.arange(8), [8]), "ok": _pieces("ok", torch.arange(8), [8])})
    assert outs["bad"][-1].finish_reason == "error" and "echo: RuntimeError: boom" in outs["bad"][-1].error
    assert torch.equal(_audio(outs["ok"]), torch.arange(8).float().repeat_interleave(HOP))


def test_waiting_streams_do_not_spin_and_abort_drops_them():
    e = Echo()
    e.add_request(EngineRequest(request_id="w", tensors={"codes": torch.arange(3)}, final=False))
    assert not e.has_unfinished() and e.num_waiting() == 1 and e.num_running() == 0 and e.step() == []
    e.abort("w")
    assert not e.has_open_streams()
    with pytest.raises(EngineError, match="codes after the piece marked final"):
        e.add_request(EngineRequest(request_id="f", tensors={"codes": torch.arange(3)}))
        e.add_request(EngineRequest(request_id="f", tensors={"codes": torch.arange(3)}))
    with pytest.raises(EngineError, match=r"codes must be integers"):
        e.add_request(EngineRequest(request_id="g", tensors={"codes": torch.zeros(2)}))


def test_sleep_moves_the_weights_off_the_device_only_when_idle():
    moved = []
    off = IdleOffload("echo", torch.device("cuda"), off=lambda: moved.append("cpu"),
                      on=lambda: moved.append("cuda"))     # nothing runs on the device here
    with pytest.raises(EngineError, match="echo cannot sleep with 2 stream"):
        off.sleep(2)
    off.sleep(0)
    off.sleep(0)                                   # asleep already: nothing moves
    off.wake_up()
    off.wake_up()                                  # awake already: nothing moves
    assert moved == ["cpu", "cuda"] and not off.sleeping
    e = Echo()
    with pytest.raises(EngineError, match="echo on CPU cannot sleep"):
        e.sleep()
    e.offload = IdleOffload("echo", torch.device("cuda"), off=lambda: e.move_to(torch.device("cpu")),
                            on=lambda: e.move_to(torch.device("cuda")))
    e.sleep()
    assert e.is_sleeping() and e.moved == ["cpu"] and e.step() == []
    with pytest.raises(EngineError, match="echo is asleep"):
        e.add_request(EngineRequest(request_id="s", tensors={"codes": torch.arange(3)}))
    e.wake_up()
    assert not e.is_sleeping() and e.moved == ["cpu", "cuda"]
