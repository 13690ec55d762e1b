"""DiffusionEngine's admission (the loop every diffusion family shares) with a fake family: no model, each
admission counted."""

from __future__ import annotations

import pytest
import torch

from omni.engines.base import EngineRequest, ImageParams
from omni.engines.diffusion import DiffusionEngine, Job

PARAMS = ImageParams(width=16, height=16, num_inference_steps=2, guidance_scale=1.0)


class Pipe:
    def to(self, device):
        return self


class Fatal(RuntimeError):
    fatal = True


class Fake(DiffusionEngine):
    size_multiple, max_pixels, max_steps = 8, 1 << 20, 50

    def __init__(self, rows: int, fail: dict[str, Exception] | None = None):
        super().__init__("fake", device="cpu", dtype="float32", threads=None, max_batch_rows=rows,
                         encode_cache=0, pipeline=Pipe())
        self.admitted: list[str] = []
        self.fail = fail or {}

    def make_job(self, request: EngineRequest) -> Job:
        return Job(request.request_id, request.image, None, request.text)

    def admit(self, job: Job) -> None:
        if job.request_id in self.fail:
            raise self.fail[job.request_id]
        self.admitted.append(job.request_id)
        job.latents = torch.zeros(job.params.n, 1)

    def denoise(self, batch: list[Job]) -> None:
        for j in batch:
            j.done += 1

    def decode(self, jobs: list[Job]) -> list[torch.Tensor]:
        return [torch.zeros(j.params.n, 1) for j in jobs]


def add(engine: Fake, *ids: str) -> None:
    for rid in ids:
        engine.add_request(EngineRequest(request_id=rid, text="a cat", image=PARAMS))


def test_a_burst_is_admitted_as_the_batch_takes_it():
    e = Fake(rows=2)
    add(e, "r0", "r1", "r2", "r3", "r4")
    assert e.step() == [] and e.admitted == ["r0", "r1"]    # not the whole queue at once
    assert {o.request_id for o in e.step()} == {"r0", "r1"} and e.admitted == ["r0", "r1"]
    e.step()
    assert e.admitted == ["r0", "r1", "r2", "r3"]
    done = set()
    while e.has_unfinished():
        done |= {o.request_id for o in e.step() if o.finished and o.error is None}
    assert done == {"r2", "r3", "r4"} and e.admitted == ["r0", "r1", "r2", "r3", "r4"]


def test_a_failed_admission_fails_its_request_and_the_next_takes_its_place():
    e = Fake(rows=2, fail={"r0": ValueError("bad prompt")})
    add(e, "r0", "r1", "r2", "r3")
    outs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r0", "error")]
    assert "admission failed: ValueError: bad prompt" in outs[0].error
    assert e.admitted == ["r1", "r2"]


def test_a_fatal_error_at_admission_ends_the_engine():
    e = Fake(rows=2, fail={"r1": Fatal("CUDA error: an illegal memory access was encountered")})
    add(e, "r0", "r1")
    with pytest.raises(Fatal):
        e.step()
