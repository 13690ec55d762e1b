"""Issue 26: `omni serve DIR` of a tiny Qwen-Image folder (real architecture, seeded random weights)
answers POST /v1/images/generations with the PNG diffusers' own QwenImagePipeline makes for the same
folder, seed, size and steps, pixel for pixel (float32, CPU); bad input is a 400 naming the parameter."""

from __future__ import annotations

import base64
import io
import threading

import httpx
import numpy as np
import pytest

from tests.e2e.harness import omni_env, served, wait_until

pytestmark = [pytest.mark.e2e]
diffusers = pytest.importorskip("diffusers")

NAME = "qwen-image-tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.qwen_image.tiny import build

    return build(tmp_path_factory.mktemp("qi") / "any-folder-name")


@pytest.fixture(scope="module")
def server(tiny):
    with served(str(tiny), "--port", "0", "--served-model-name", NAME,
                env=omni_env(OMNI_PLATFORM="cpu", OMP_NUM_THREADS="1")) as url:
        yield url


@pytest.fixture(scope="module")
def pipe(tiny):
    import torch

    torch.set_num_threads(1)
    p = diffusers.QwenImagePipeline.from_pretrained(str(tiny), dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def reference(pipe, prompt: str, *, size=(64, 48), steps=3, seed=11, n=1, scale=4.0, negative=" "):
    import torch

    images = pipe(prompt, negative_prompt=negative, true_cfg_scale=scale, width=size[0], height=size[1],
                  num_inference_steps=steps, num_images_per_prompt=n,
                  generator=torch.Generator().manual_seed(seed)).images
    return [np.asarray(im) for im in images]


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert im.format == "PNG" and im.mode == "RGB"
    return np.asarray(im)


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"model": NAME, **body}, timeout=120)


def test_the_served_image_is_the_pipelines_pixel_for_pixel(server, pipe):
    r = generate(server, prompt="a red cat on the mountain", size="64x48", num_inference_steps=3, seed=11,
                 guidance_scale=4.0, response_format="b64_json")
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["created"], int) and len(body["data"]) == 1
    assert np.array_equal(pixels(body["data"][0]["b64_json"]), reference(pipe, "a red cat on the mountain")[0])


def test_n_images_and_a_negative_prompt(server, pipe):
    r = generate(server, prompt="blue sea", size="32x32", num_inference_steps=2, seed=5, n=2,
                 guidance_scale=2.5, negative_prompt="dark")
    assert r.status_code == 200, r.text
    want = reference(pipe, "blue sea", size=(32, 32), steps=2, seed=5, n=2, scale=2.5, negative="dark")
    got = [pixels(d["b64_json"]) for d in r.json()["data"]]
    assert len(got) == 2 and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_concurrent_requests_batch_and_stay_within_rounding(server, pipe):
    prompts = ["a red cat", "the big dog runs home", "sun over the sea", "green tree"]
    out: dict = {}

    def one(i: int, prompt: str) -> None:
        out[i] = generate(server, prompt=prompt, size="64x48", num_inference_steps=3, seed=i)

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, prompt in enumerate(prompts):
        assert out[i].status_code == 200, out[i].text
        diff = np.abs(pixels(out[i].json()["data"][0]["b64_json"]).astype(int)
                      - reference(pipe, prompt, seed=i)[0].astype(int))
        assert diff.max() <= 1, (prompt, diff.max())


@pytest.mark.parametrize("body, param", [
    ({"size": "60x48"}, "size"),
    ({"size": "1024x1024"}, "size"),                  # over the CPU deployment's 512x512
    ({"size": "big"}, "size"),
    ({"n": 5}, "n"),
    ({"num_inference_steps": 101}, "num_inference_steps"),
    ({"response_format": "url"}, "response_format"),
    ({"quality": "hd"}, "quality"),
    ({"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_input_is_a_400_naming_the_parameter(server, body, param):
    r = generate(server, **{"prompt": "a cat", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_is_a_404(server):
    r = httpx.post(f"{server}/v1/images/generations", json={"model": "nope", "prompt": "a"}, timeout=30)
    assert r.status_code == 404


def test_the_stages_progress_gauges_reach_metrics(server):
    """The engine's gauges ride the stage's load report (about a second behind) into /metrics."""
    assert generate(server, prompt="a", size="32x32", num_inference_steps=1, seed=1).status_code == 200

    def images_total():
        for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines():
            if line.startswith("omni_stage_engine_images_total{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    wait_until(lambda: images_total() >= 1, 15, "omni_stage_engine_images_total in /metrics")
    text = httpx.get(f"{server}/metrics", timeout=30).text
    assert 'omni_stage_engine_image_steps_left{stage="0",replica="0"}' in text
