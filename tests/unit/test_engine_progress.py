"""A long engine step that moves is no stall: the engine marks progress from inside it (Engine.progressed, the
worker's LoopWatch), a diffusion engine after each block of its models, so pipeline.loop_stall_s (120 s) no
longer marks a CPU diffusion stage DEAD in a text encoder pass or a denoising step of minutes; a step that
marks nothing is still a hang. Before, an engine had no progressed() and only a returned step counted."""

from __future__ import annotations

import threading
import time

import torch

from omni.engines.base import EngineOutput, EngineRequest
from omni.engines.progress import mark_blocks
from tests.unit.test_diffusion_admission import PARAMS, Fake
from tests.unit.test_stage_loop_stall import add, start, stop
from tests.unit.test_stage_worker import CountEngine, dealer, hello, recv


class LongStepEngine(CountEngine):
    """One step of `step_s` (a CPU encoder pass, a denoising step), marking progress every 50 ms or never."""

    def __init__(self, step_s: float, marks: bool):
        super().__init__()
        self.step_s, self.marks = step_s, marks
        self.in_step, self.done = threading.Event(), threading.Event()

    def step(self) -> list[EngineOutput]:
        self.in_step.set()
        end = time.monotonic() + self.step_s
        while time.monotonic() < end:
            self.done.wait(0.05)      # computing
            if self.marks:
                self.progressed()
        return super().step()


def wedged_during_step(marks: bool) -> bool:
    loop_stall_s = 0.3
    engine = LongStepEngine(step_s=5 * loop_stall_s, marks=marks)
    w, t = start(engine, loop_stall_s)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        add(s, "r1", max_tokens=1)
        assert engine.in_step.wait(10)
        seen, deadline = False, time.monotonic() + 10
        while not s.poll(20):
            assert time.monotonic() < deadline, "no output"
            seen = seen or w.loop_watch.wedged() is not None
        out = recv(s)
        assert out.token_ids == [2] and out.finished
        return seen
    finally:
        s.close()
        stop(w, t)


def test_a_long_step_that_marks_progress_never_wedges_and_one_that_does_not_does():
    assert not wedged_during_step(marks=True)
    assert wedged_during_step(marks=False)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(1, 1)

    def forward(self, x):
        return self.proj(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.out = torch.nn.ModuleList([torch.nn.Linear(1, 1)])   # a leaf layer: not a block

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out[0](x)


def test_blocks_are_marked_and_leaf_layers_not():
    marks = []
    net = Net()
    assert mark_blocks(net, lambda: marks.append(1)) == 3
    assert mark_blocks(object(), lambda: None) == 0   # a tokenizer, a scheduler
    net(torch.zeros(1, 1))
    assert len(marks) == 3


class NetPipe:
    def __init__(self):
        self.components = {"transformer": Net(), "scheduler": object()}

    def to(self, device):
        return self


class NetFake(Fake):
    """Fake's family whose denoising step runs the pipeline's transformer."""

    def __init__(self):
        super(Fake, self).__init__("fake", device="cpu", dtype="float32", threads=None, max_batch_rows=2,
                                   encode_cache=0, pipeline=NetPipe())
        self.admitted, self.fail = [], {}

    def denoise(self, batch):
        self.pipe.components["transformer"](torch.zeros(1, 1))
        super().denoise(batch)


def test_a_diffusion_step_marks_after_each_admission_block_and_denoising_step():
    e = NetFake()
    marks = []
    e.progress_hook = lambda: marks.append(1)
    e.add_request(EngineRequest(request_id="a", text="a cat", image=PARAMS))
    e.add_request(EngineRequest(request_id="b", text="a dog", image=PARAMS))
    e.step()
    assert len(marks) == 2 + 3 + 1     # two admissions, the DiT's 3 blocks, the step's end
