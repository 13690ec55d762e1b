"""The qwen_image engine against diffusers' own QwenImagePipeline on the tiny folder, float32, on the same
device (cpu, then cuda where a GPU is present, without TF32): a request alone in its batch is the pipeline's
image bit for bit; batched requests differ by float32 rounding only (at most one level of one 8-bit channel)."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, ImageParams

diffusers = pytest.importorskip("diffusers")

PARAMS = ImageParams(width=64, height=48, num_inference_steps=4, guidance_scale=4.0, negative_prompt=" ", seed=7)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.qwen_image.tiny import build

    return build(tmp_path_factory.mktemp("qwen-image"))


@pytest.fixture(scope="module")
def engine(folder, device):
    from omni.models.qwen_image.engine import QwenImageEngine

    torch.set_num_threads(1)
    return QwenImageEngine(folder, device=device)


@pytest.fixture(scope="module")
def pipe(folder, device):
    p = diffusers.QwenImagePipeline.from_pretrained(str(folder), dtype=torch.float32).to(device)
    p.set_progress_bar_config(disable=True)
    return p


def digest(d) -> dict[str, str]:
    """A folder's files and their hashes."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_tiny_folder_is_a_diffusers_folder_byte_identical_per_seed(folder, tmp_path):
    from omni.models.qwen_image.tiny import build

    first = digest(folder)
    assert first == digest(build(tmp_path / "again"))
    assert {"model_index.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
            "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"} <= set(first)


def reference(pipe, prompt: str, p: ImageParams) -> np.ndarray:
    images = pipe(prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.guidance_scale, height=p.height,
                  width=p.width, num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.n,
                  generator=torch.Generator().manual_seed(p.seed)).images
    return np.stack([np.asarray(im) for im in images])


def run(engine, requests: dict[str, tuple[str, ImageParams]]) -> dict[str, np.ndarray]:
    """Each request's output (an image or a video: the engine's `unit`), stepping until all are done."""
    for rid, (prompt, p) in requests.items():
        engine.add_request(EngineRequest(request_id=rid, text=prompt, image=p))
    out = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.finished and o.error is None, o.error
            out[o.request_id] = o.tensors[engine.unit].numpy()
    return out


@pytest.mark.parametrize("params", [
    PARAMS,                                                                    # true CFG with " "
    msgspec.structs.replace(PARAMS, guidance_scale=1.0, negative_prompt=None, n=2, width=32, height=32),
    msgspec.structs.replace(PARAMS, guidance_scale=2.5, negative_prompt="blurry dark", n=2, seed=123),
], ids=["cfg", "n2-no-guidance", "n2-negative-prompt"])
def test_a_request_alone_is_the_pipelines_image_bit_for_bit(engine, pipe, params):
    got = run(engine, {"a": ("a red cat on the mountain", params)})["a"]
    want = reference(pipe, "a red cat on the mountain", params)
    assert got.dtype == np.uint8 and got.shape == (params.n, params.height, params.width, 3)
    assert np.array_equal(got, want)


def test_a_cached_encoding_gives_the_same_image(engine, pipe):
    hits = engine.stats().get("encode_cache_hits", 0)
    again = run(engine, {"again": ("a red cat on the mountain", PARAMS)})["again"]
    assert engine.stats()["encode_cache_hits"] == hits + 2     # the prompt and " ", both seen before
    assert np.array_equal(again, reference(pipe, "a red cat on the mountain", PARAMS))


def test_prompt_token_ids_are_the_encoders_input(engine, pipe):
    ids = engine.token_ids("a red cat")
    engine.add_request(EngineRequest(request_id="ids", prompt_token_ids=ids, image=PARAMS))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert np.array_equal(outs[0].tensors["image"].numpy(), reference(pipe, "a red cat", PARAMS))


def test_batched_requests_share_each_step_and_stay_within_float_rounding(engine, pipe):
    requests = {
        "x": ("a red cat", PARAMS),
        "y": ("the big dog runs home over the hill", msgspec.structs.replace(PARAMS, seed=3, num_inference_steps=6)),
        "z": ("sun", msgspec.structs.replace(PARAMS, seed=5, negative_prompt=None, guidance_scale=1.0, n=2)),
        "other-size": ("sea", msgspec.structs.replace(PARAMS, width=32, height=32)),
    }
    steps0 = engine.stats()["steps"]
    out = run(engine, requests)
    # x, y, z share their steps (6 for the longest), the other size steps apart (4)
    assert engine.stats()["steps"] - steps0 == 6 + 4
    for rid, (prompt, p) in requests.items():
        diff = np.abs(out[rid].astype(int) - reference(pipe, prompt, p).astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (rid, diff.max(), (diff > 0).sum())


def test_abort_between_steps_and_progress(engine):
    engine.add_request(EngineRequest(request_id="gone", text="a", image=PARAMS))
    engine.add_request(EngineRequest(request_id="kept", text="b", image=PARAMS))
    engine.step()
    assert engine.progress() == {"gone": (1, 4), "kept": (1, 4)}
    gauges = engine.load_extra()      # what the stage's load report (omni status, /metrics) carries
    assert gauges["image_requests"] == 2 and gauges["image_steps_done"] == 2 and gauges["image_steps_left"] == 6
    assert gauges["image_requests_waiting"] == 0 and engine.stats()["image_steps_done"] == 2
    engine.abort("gone")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["kept"]


@pytest.mark.parametrize("change, message", [
    ({"width": 40}, "multiples of 16"),
    ({"width": 4096, "height": 4096}, "pixels; the limit"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"n": 9}, "max_batch_rows"),
])
def test_what_the_model_cannot_make_is_refused_by_name(engine, change, message):
    with pytest.raises(EngineError, match=message):
        engine.add_request(EngineRequest(request_id="bad", text="a", image=msgspec.structs.replace(PARAMS, **change)))
    with pytest.raises(EngineError, match="no image parameters"):
        engine.add_request(EngineRequest(request_id="bad", text="a"))
    with pytest.raises(EngineError, match="prompt_token_ids: 3 ids"):
        engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=[1, 2, 3], image=PARAMS))


def test_level_2_sleep_drops_the_weights_and_wake_up_reads_them_again(engine):
    """On any device: a CPU stage has nothing to move off a device, but level 2 frees its host memory."""
    before = run(engine, {"a": ("a red cat", PARAMS)})["a"]
    assert engine.can_sleep()
    engine.add_request(EngineRequest(request_id="open", text="a", image=PARAMS))
    with pytest.raises(EngineError, match="1 image request"):
        engine.sleep(2)
    engine.abort("open")
    with pytest.raises(EngineError, match="level must be 1 or 2"):
        engine.sleep(3)
    engine.sleep(2)
    assert engine.is_sleeping() and engine.pipe is None
    engine.sleep(1)                      # deeper already: nothing to do
    engine.wake_up()
    assert not engine.is_sleeping() and next(engine.pipe.transformer.parameters()).device.type == engine.device.type
    assert np.array_equal(run(engine, {"b": ("a red cat", PARAMS)})["b"], before)


def test_level_2_needs_a_folder_to_read_again(pipe):
    from omni.models.qwen_image.engine import QwenImageEngine

    built = QwenImageEngine(None, device=pipe.device.type, pipeline=pipe)
    with pytest.raises(EngineError, match="no folder to read the weights from again"):
        built.sleep(2)


def test_sleep_moves_the_weights_off_the_gpu_and_is_refused_on_cpu(engine):
    if engine.device.type == "cpu":
        with pytest.raises(EngineError, match="on CPU cannot sleep at level 1: .*level 2 drops them"):
            engine.sleep()
        return
    engine.add_request(EngineRequest(request_id="open", text="a", image=PARAMS))
    with pytest.raises(EngineError, match="1 image request"):
        engine.sleep()
    engine.abort("open")
    engine.sleep()
    assert engine.is_sleeping() and next(engine.pipe.transformer.parameters()).device.type == "cpu"
    engine.wake_up()
    assert not engine.is_sleeping() and next(engine.pipe.transformer.parameters()).device.type == "cuda"
    assert run(engine, {"a": ("a", PARAMS)})["a"].shape == (1, 48, 64, 3)
