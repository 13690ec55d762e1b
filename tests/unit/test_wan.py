"""The wan engine against diffusers' own WanPipeline on the tiny folder, float32, on the same device (cpu,
then cuda where a GPU is present, without TF32): a request alone in its batch is the pipeline's video bit
for bit (output_type "np", x 255 rounded to uint8); batched requests differ by float32 rounding only."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, ImageParams
from tests.unit.test_qwen_image import digest, run

diffusers = pytest.importorskip("diffusers")

PARAMS = ImageParams(width=32, height=48, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
                     negative_prompt="blurry", seed=7)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.wan.tiny import build

    return build(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="module")
def engine(folder, device):
    from omni.models.wan.engine import WanEngine

    torch.set_num_threads(1)
    return WanEngine(folder, device=device)


@pytest.fixture(scope="module")
def pipe(folder, device):
    p = diffusers.WanPipeline.from_pretrained(str(folder), dtype=torch.float32).to(device)
    p.set_progress_bar_config(disable=True)
    return p


def test_tiny_folder_is_a_wan_folder_byte_identical_per_seed(folder, tmp_path):
    from omni.models.wan.tiny import build

    first = digest(folder)
    assert first == digest(build(tmp_path / "again"))
    assert {"model_index.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
            "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"} <= set(first)


def reference(pipe, prompt: str, p: ImageParams) -> np.ndarray:
    from omni.models.wan.engine import to_uint8

    frames = pipe(prompt, negative_prompt=p.negative_prompt, guidance_scale=p.guidance_scale, height=p.height,
                  width=p.width, num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                  num_videos_per_prompt=p.n, generator=torch.Generator().manual_seed(p.seed), output_type="np").frames
    return to_uint8(frames)


@pytest.mark.parametrize("params", [
    PARAMS,
    msgspec.structs.replace(PARAMS, guidance_scale=1.0, negative_prompt=None, n=2, num_frames=9, seed=1),
    msgspec.structs.replace(PARAMS, negative_prompt=None, num_frames=1, width=48, height=32),   # "" as negative
], ids=["cfg", "n2-no-guidance", "one-frame-default-negative"])
def test_a_request_alone_is_the_pipelines_video_bit_for_bit(engine, pipe, params):
    got = run(engine, {"a": ("a red cat on the mountain", params)})["a"]
    want = reference(pipe, "a red cat on the mountain", params)
    assert got.dtype == np.uint8 and got.shape == (params.n, params.num_frames, params.height, params.width, 3)
    assert np.array_equal(got, want)


def test_batched_requests_share_each_step_and_stay_within_float_rounding(engine, pipe):
    requests = {
        "x": ("a red cat", PARAMS),
        "y": ("the big dog runs home", msgspec.structs.replace(PARAMS, seed=3, num_inference_steps=4)),
        "z": ("sun", msgspec.structs.replace(PARAMS, seed=5, negative_prompt=None, guidance_scale=1.0)),
        "other-frames": ("sea", msgspec.structs.replace(PARAMS, num_frames=1)),
    }
    steps0 = engine.stats()["steps"]
    out = run(engine, requests)
    assert engine.stats()["steps"] - steps0 == 4 + 3      # x, y, z share their steps; the 1-frame one apart
    for rid, (prompt, p) in requests.items():
        diff = np.abs(out[rid].astype(int) - reference(pipe, prompt, p).astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (rid, diff.max(), (diff > 0).sum())


def test_wan22_two_transformers_switch_at_the_boundary(folder, pipe, device):
    """Wan2.2 A14B's layout: `transformer` for the high-noise steps, `transformer_2` below the boundary."""
    from omni.models.wan.engine import WanEngine

    torch.manual_seed(11)
    second = diffusers.WanTransformer3DModel(**pipe.transformer.config).eval().to(device)
    two = diffusers.WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                transformer=pipe.transformer, transformer_2=second, scheduler=pipe.scheduler,
                                boundary_ratio=0.9)
    two.set_progress_bar_config(disable=True)
    p = msgspec.structs.replace(PARAMS, num_inference_steps=4)
    got = run(WanEngine(None, device=device, pipeline=two), {"a": ("a red cat", p)})["a"]
    assert np.array_equal(got, reference(two, "a red cat", p))
    assert not np.array_equal(got, reference(pipe, "a red cat", p))


def test_abort_between_steps_and_progress(engine):
    engine.add_request(EngineRequest(request_id="gone", text="a", image=PARAMS))
    engine.add_request(EngineRequest(request_id="kept", text="b", image=PARAMS))
    engine.step()
    assert engine.progress() == {"gone": (1, 3), "kept": (1, 3)}
    gauges = engine.load_extra()
    assert gauges["video_requests"] == 2 and gauges["video_steps_done"] == 2 and gauges["video_steps_left"] == 4
    engine.abort("gone")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["kept"] and engine.stats()["videos_total"] >= 1


@pytest.mark.parametrize("change, message", [
    ({"width": 40}, "multiples of 16"),
    ({"width": 4096, "height": 4096}, "pixels; the limit"),
    ({"num_frames": 6}, "num_frames must be 1 more than a multiple of 4"),
    ({"num_frames": 85}, "at most 81"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"n": 9}, "max_batch_rows"),
    # the tiny DiT's rotary table has 64 positions a side: 64 x 16 px (the real one 1024: 16384 px)
    ({"width": 1040, "height": 16}, "width is at most 1024 and the height at most 1024"),
    ({"width": 16, "height": 1040}, "rotary table"),
])
def test_what_the_model_cannot_make_is_refused_by_name(engine, change, message):
    with pytest.raises(EngineError, match=message):
        engine.add_request(EngineRequest(request_id="bad", text="a", image=msgspec.structs.replace(PARAMS, **change)))
    with pytest.raises(EngineError, match="no video parameters"):
        engine.add_request(EngineRequest(request_id="bad", text="a"))
    with pytest.raises(EngineError, match="has no text"):
        engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=[1, 2, 3], image=PARAMS))


def test_a_side_at_the_rotary_tables_bound_is_made(engine):
    p = msgspec.structs.replace(PARAMS, width=1024, height=16, num_frames=1, num_inference_steps=1)
    assert run(engine, {"wide": ("a", p)})["wide"].shape == (1, 1, 16, 1024, 3)


def test_a_batch_whose_step_raises_fails_its_own_requests_only(engine, monkeypatch):
    """A request past the checks that the transformer refuses (here: one the old check let through, wider
    than the rotary table) fails alone; the request the stage holds beside it is still made."""
    engine.add_request(EngineRequest(request_id="good", text="a cat", image=PARAMS))
    engine.step()
    monkeypatch.setattr(engine, "check", lambda p: None)
    wide = msgspec.structs.replace(PARAMS, width=1040, height=16, num_frames=1)
    engine.add_request(EngineRequest(request_id="wide", text="a dog", image=wide))
    outs = []
    for _ in range(20):
        if not engine.has_unfinished():
            break
        outs += engine.step()
    got = {o.request_id: o for o in outs}
    assert got["wide"].finish_reason == "error" and "denoising failed" in got["wide"].error
    assert got["good"].finish_reason == "stop" and got["good"].error is None
    assert not engine.has_unfinished() and engine.progress() == {}


def test_level_2_sleep_drops_the_weights_and_wake_up_reads_them_again(engine):
    before = run(engine, {"a": ("a red cat", PARAMS)})["a"]
    engine.add_request(EngineRequest(request_id="open", text="a", image=PARAMS))
    with pytest.raises(EngineError, match="1 video request"):
        engine.sleep(2)
    engine.abort("open")
    engine.sleep(2)
    assert engine.is_sleeping() and engine.pipe is None
    engine.wake_up()
    assert not engine.is_sleeping()
    assert np.array_equal(run(engine, {"b": ("a red cat", PARAMS)})["b"], before)
    if engine.device.type == "cpu":
        with pytest.raises(EngineError, match="on CPU cannot sleep at level 1"):
            engine.sleep()


def test_its_text_encoder_dit_and_vae_mark_progress_block_by_block(engine):
    """pipeline.loop_stall_s: a CPU encoder pass or denoising step of minutes says it moves from inside."""
    marks = []
    engine.progress_hook = lambda: marks.append(1)
    try:
        one_step = msgspec.structs.replace(PARAMS, num_inference_steps=1)
        engine.add_request(EngineRequest(request_id="marked", text="a", image=one_step))
        n = {k: len([b for b in getattr(engine.pipe, k).modules() if isinstance(b, torch.nn.ModuleList)])
             for k in ("text_encoder", "transformer", "vae")}
        assert all(n.values()), n
        assert [o.request_id for o in engine.step()] == ["marked"]   # admission (CFG: 2 encodes), a step, decode
        assert len(marks) > sum(n.values())
    finally:
        engine.progress_hook = None
