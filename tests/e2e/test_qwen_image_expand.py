"""Issue 26: the AR -> DiT pipeline served with two frontends. `omni serve DIR --deploy-config
qwen-image-prompt-expand --api-server-count 2` on a tiny Qwen-Image folder: SmolLM2-135M-Instruct
(stage 0) expands the client's prompt, the qwen_image stage renders it. Through each frontend the
answer's `revised_prompt` is what transformers' greedy generate() writes for the deploy's chat, and each
image is diffusers' QwenImagePipeline's for that prompt, seed, size and steps, pixel for pixel
(float32, CPU, one request at a time so each is alone in its batch). The writer's max_tokens is cut to
24 (a stage override) to keep the test short: greedy SmolLM2 takes ~0.1 s a token here, twice over."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni import config
from tests.e2e.harness import omni_env, served, until_frontend
# The one-stage test's tiny folder, diffusers' pipeline on it, and its reference and PNG reader.
from tests.e2e.test_qwen_image import pipe, pixels, reference, tiny  # noqa: F401

pytestmark = [pytest.mark.e2e]
diffusers = pytest.importorskip("diffusers")

NAME = "qwen-image-expand"
DEPLOY = "qwen-image-prompt-expand"
OVERRIDES = {"0": {"default_sampling_params": {"max_tokens": 24}}}


@pytest.fixture(scope="module")
def deploy(tiny):  # noqa: F811
    """The writer stage and the chat as served (they are the same on every platform)."""
    return config.load(str(tiny), DEPLOY, stage_overrides=OVERRIDES)


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    with served(str(tiny), "--deploy-config", DEPLOY, "--port", "0", "--served-model-name", NAME,
                "--api-server-count", "2", "--stage-overrides", json.dumps(OVERRIDES),
                env=omni_env(OMNI_PLATFORM="cpu", OMP_NUM_THREADS="1")) as url:
        yield url


@pytest.fixture(scope="module")
def writer(deploy):
    """transformers' own model and tokenizer of the writer stage's LM, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni.models.resolve import resolve_model

    torch.set_num_threads(1)
    path = resolve_model(deploy.stages[0].model)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def chat(deploy, prompt: str) -> list[dict]:
    expand = deploy.pipeline.images.expand
    return [{"role": "system", "content": expand.system},
            {"role": "user", "content": expand.user.replace("{prompt}", prompt)}]


def written(writer, deploy, prompt: str) -> str:
    """What the LM writes for the deploy's chat around `prompt`: greedy, the deploy's max_tokens."""
    import torch

    model, tok = writer
    ids = tok.apply_chat_template(chat(deploy, prompt), add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=deploy.stages[0].default_sampling_params.max_tokens)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


@pytest.mark.parametrize("frontend, prompt, n, seed", [("0", "a red cat on the mountain", 1, 11),
                                                       ("1", "a lighthouse in a storm", 2, 12)])
def test_each_frontend_serves_the_lm_expanded_image(server, deploy, writer, pipe, frontend, prompt, n, seed):  # noqa: F811
    r = until_frontend(server, frontend, "POST", "/v1/images/generations", json={
        "model": NAME, "prompt": prompt, "size": "64x48", "n": n, "num_inference_steps": 3, "seed": seed})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    revised = data[0]["revised_prompt"]
    assert [d["revised_prompt"] for d in data] == [revised] * n
    assert revised == written(writer, deploy, prompt) and revised != prompt
    want = reference(pipe, revised, size=(64, 48), steps=3, seed=seed, n=n, scale=4.0, negative=" ")
    assert len(data) == n and all(np.array_equal(pixels(d["b64_json"]), w) for d, w in zip(data, want))


def test_text_chat_reaches_the_writer_alone(server, deploy, writer):
    """The LM stage is a final text output too: chat with the same messages gets the same text."""
    r = until_frontend(server, "1", "POST", "/v1/chat/completions", json={
        "model": NAME, "messages": chat(deploy, "green tree")})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == written(writer, deploy, "green tree")


def test_bad_input_is_a_400_naming_the_parameter(server):
    r = until_frontend(server, "0", "POST", "/v1/images/generations",
                       json={"model": NAME, "prompt": "a", "size": "60x48"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
