"""POST /v1/images/generations against an in-memory fake orchestrator: what the stage is asked for
(defaults under the client's values), the response shape, and every refusal naming its parameter."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import msgspec
import numpy as np
import pytest

from omni.api import build_app
from omni.api.jobs import Jobs
from omni.config import ImageSettings, PromptExpansion
from omni.sampling import SamplingOverrides
from omni.errors import StageFailed
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from tests.unit.api_fakes import tokenizer  # noqa: F401  (a byte-level BPE with a chat template)

pytestmark = pytest.mark.anyio
SETTINGS = ImageSettings(default_size="64x32", max_pixels=128 * 128, default_steps=7, max_steps=20, max_n=3)


class FakeImages:
    """Answers an image request with n images whose pixels encode the row index."""

    def __init__(self):
        self.requests: list[PipelineRequest] = []
        self.fail: Exception | None = None
        self.written: str | None = None     # the prompt an upstream stage wrote (PipelineOutput.prompt)

    async def generate(self, request: PipelineRequest):
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        p = request.image
        rows = np.zeros((p.n, p.height, p.width, 3), dtype=np.uint8)
        for i in range(p.n):
            rows[i] = i * 40
        yield PipelineOutput(request_id=request.request_id, stage_id=0, modality="image", finished=True,
                             image=rows.tobytes(), image_shape=rows.shape, prompt=self.written)

    def health(self):
        return True, ""


def make(images: ImageSettings | None = SETTINGS, tokenizer=None, **kw):  # noqa: F811
    orch = FakeImages()
    app = build_app(orch, tokenizer, served_model_name="img", max_model_len=kw.pop("max_model_len", 16),
                    images=images, **kw)
    return orch, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


async def test_defaults_fill_what_the_client_left_out():
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"created", "data"} and len(body["data"]) == 1
    assert set(body["data"][0]) == {"b64_json"}       # nothing revised the prompt
    assert pixels(body["data"][0]["b64_json"]).shape == (32, 64, 3)
    req = orch.requests[0]
    assert req.text == "a cat" and req.modalities == ("image",)
    p = req.image
    assert (p.width, p.height, p.num_inference_steps, p.guidance_scale, p.negative_prompt, p.n) == \
        (64, 32, 7, 4.0, " ", 1)
    assert 0 <= p.seed < 2**63


async def test_the_clients_values_reach_the_stage_and_n_images_come_back_in_order():
    orch, client = make()
    r = await client.post("/v1/images/generations", json={
        "model": "img", "prompt": "a cat", "n": 3, "size": "32x48", "seed": 5, "num_inference_steps": 2,
        "guidance_scale": 2.0, "negative_prompt": "dark", "response_format": "b64_json", "user": "u1"})
    assert r.status_code == 200, r.text
    got = [pixels(d["b64_json"]) for d in r.json()["data"]]
    assert [g.shape for g in got] == [(48, 32, 3)] * 3 and [int(g[0, 0, 0]) for g in got] == [0, 40, 80]
    p = orch.requests[0].image
    assert (p.width, p.height, p.n, p.seed, p.num_inference_steps, p.guidance_scale, p.negative_prompt) == \
        (32, 48, 3, 5, 2, 2.0, "dark")


@pytest.mark.parametrize("extra", [{"true_cfg_scale": 2.5}, {"true_cfg_scale": 2.5, "guidance_scale": 2.5},
                                   {"guidance_scale": 2.5, "output_format": "png"}])
async def test_vllm_omnis_true_cfg_scale_and_output_format_png_are_taken(extra):
    """vllm-omni's Qwen-Image request names its guidance true_cfg_scale and may ask output_format png: both
    were 'unknown field'. true_cfg_scale is the guidance_scale the stage gets."""
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a cat", **extra})
    assert r.status_code == 200, r.text
    assert orch.requests[0].image.guidance_scale == 2.5 and orch.requests[0].image.negative_prompt == " "


async def test_no_guidance_has_no_negative_prompt():
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a", "guidance_scale": 1.0})
    assert r.status_code == 200 and orch.requests[0].image.negative_prompt is None


BAD = [
    ({"size": "40x32"}, "size", "multiples of 16"),
    ({"size": "0x32"}, "size", "multiples of 16"),
    ({"size": "256x256"}, "size", "the limit is 16384"),
    ({"size": "64"}, "size", None),
    ({"n": 4}, "n", "the limit is 3"),
    ({"n": 0}, "n", None),
    ({"num_inference_steps": 21}, "num_inference_steps", "the limit is 20"),
    ({"response_format": "url"}, "response_format", "not supported"),
    ({"quality": "hd"}, "quality", "unknown field"),
    ({"style": "vivid"}, "style", "unknown field"),
    ({"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt", "needs guidance"),
    ({"guidance_scale": -1}, "guidance_scale", None),
    ({"prompt": "   "}, "prompt", None),
    ({"prompt": "x" * 4001}, "prompt", None),
    ({"seed": -1}, "seed", None),
    ({"output_format": "jpeg"}, "output_format", "omni returns PNG"),
    ({"output_format": "webp"}, "output_format", "omni returns PNG"),
    ({"true_cfg_scale": 4.0, "guidance_scale": 1.0}, "true_cfg_scale", "give one"),
    ({"true_cfg_scale": 51}, "true_cfg_scale", None),
    ({"true_cfg_scale": 1.0, "negative_prompt": "x"}, "negative_prompt", "needs guidance"),
]


@pytest.mark.parametrize("body, param, says", BAD)
async def test_bad_input_is_a_400_naming_the_parameter(body, param, says):
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a cat", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert says is None or says in err["message"], err
    assert orch.requests == []


async def test_a_pipeline_without_images_answers_404_and_a_stage_failure_500():
    _, client = make(None)
    r = await client.post("/v1/images/generations", json={"prompt": "a"})
    assert r.status_code == 404 and "makes no images" in r.json()["error"]["message"]
    orch, client = make()
    r = await client.post("/v1/images/generations", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    orch.fail = StageFailed(0, "r0", "boom")
    r = await client.post("/v1/images/generations", json={"prompt": "a"})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


async def test_openapi_states_the_deployments_image_bounds():
    _, client = make()
    props = (await client.get("/openapi.json")).json()["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 3} in props["n"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 20} in props["num_inference_steps"]["anyOf"]
    assert props["prompt"]["maxLength"] == 4000 and props["model"]["anyOf"][0]["enum"] == ["img"]
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    [job] = schemas["JobRequest"]["oneOf"]     # the only endpoint a job may run on an image pipeline
    assert job["properties"]["endpoint"] == {"const": "/v1/images/generations"}
    assert job["properties"]["body"]["properties"]["n"] == props["n"]


async def settled(client: httpx.AsyncClient, job_id: str) -> dict:
    """The job once it is no longer pending (the fake answers at once; bounded)."""
    jobs: Jobs = client._transport.app.state.jobs
    tasks = list(jobs._tasks.values())
    if tasks:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    return (await client.get(f"/v1/omni/jobs/{job_id}")).json()


async def test_an_image_job_answers_what_the_sync_call_answers():
    orch, client = make()
    body = {"prompt": "a cat", "n": 2, "seed": 3}
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": body})
    assert r.status_code == 200, r.text
    job = await settled(client, r.json()["id"])
    assert job["status"] == "completed" and job["content_type"] == "application/json", job
    content = await client.get(f"/v1/omni/jobs/{job['id']}/content")
    sync = (await client.post("/v1/images/generations", json=body)).json()
    got = content.json()
    assert len(content.content) == job["bytes"] and set(got) == {"created", "data"}
    assert got["data"] == sync["data"] and len(got["data"]) == 2     # `created` is each call's own time
    assert orch.requests[0].image == orch.requests[1].image
    assert (await client.delete(f"/v1/omni/jobs/{job['id']}")).status_code == 200
    r = await client.get(f"/v1/omni/jobs/{job['id']}/content")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


@pytest.mark.parametrize("body, param, says", BAD)
async def test_a_bad_image_job_is_refused_at_create_with_the_sync_routes_400(body, param, says):
    orch, client = make()
    sync = (await client.post("/v1/images/generations", json={"prompt": "a cat", **body})).json()["error"]
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations",
                                                 "body": {"prompt": "a cat", **body}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"body.{param}" and err["message"] == f"body: {sync['message']}", err
    assert orch.requests == [] and (await client.get("/v1/omni/jobs")).json()["data"] == []


async def test_an_image_job_of_an_unknown_model_or_without_an_image_stage_is_refused():
    _, client = make()
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations",
                                                 "body": {"prompt": "a", "model": "other"}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "body.model", r.text
    _, client = make(None)
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": {"prompt": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint", r.text


async def test_an_image_job_whose_stage_fails_reads_failed_with_the_cause():
    orch, client = make()
    orch.fail = StageFailed(0, "r0", "boom")
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": {"prompt": "a"}})
    job = await settled(client, r.json()["id"])
    assert job["status"] == "failed" and "boom" in job["error"]["message"], job
    r = await client.get(f"/v1/omni/jobs/{job['id']}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_completed"


EXPAND = msgspec.structs.replace(SETTINGS, expand=PromptExpansion(system="Describe a picture.", user="Idea: {prompt}"))


async def test_an_lm_entry_gets_the_deploys_chat_and_each_image_reports_the_revised_prompt(tokenizer):  # noqa: F811
    orch, client = make(EXPAND, tokenizer, max_model_len=128,
                        sampling_defaults=SamplingOverrides(temperature=0.0, max_tokens=40), default_max_tokens=40)
    orch.written = "A red cat asleep on a mountain ledge at dusk."
    r = await client.post("/v1/images/generations", json={"prompt": "a cat", "n": 2, "seed": 1})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [sorted(d) for d in data] == [["b64_json", "revised_prompt"]] * 2
    assert {d["revised_prompt"] for d in data} == {orch.written}
    req = orch.requests[0]
    want = tokenizer.apply_chat_template([{"role": "system", "content": "Describe a picture."},
                                          {"role": "user", "content": "Idea: a cat"}],
                                         add_generation_prompt=True, tokenize=False)
    assert req.prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)
    # The client's prompt rides along (the DiT's if the LM writes nothing); the LM samples as the deploy says.
    assert (req.text, req.entry_stage, req.modalities, req.image.n) == ("a cat", 0, ("image",), 2)
    assert (req.sampling.temperature, req.sampling.max_tokens) == (0.0, 40)


async def test_a_prompt_the_lms_context_cannot_hold_is_a_400_naming_it(tokenizer):  # noqa: F811
    orch, client = make(EXPAND, tokenizer, max_model_len=24)
    r = await client.post("/v1/images/generations", json={"prompt": "the quick brown fox " * 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert orch.requests == []


@pytest.mark.parametrize("case", ["prompt over the context's characters", "no room for tokens", "no tokenizer",
                                  "fits"])
async def test_an_expand_image_job_is_refused_at_create_as_the_sync_route_refuses_it(tokenizer, case):  # noqa: F811
    """The LM's refusals (need_text, the prompt's characters, no room for a completion) were in
    pipeline_request only, so such a job was made and then failed; the create runs them now."""
    mml, prompt = {"prompt over the context's characters": (24, "the quick brown fox " * 20),
                   "no room for tokens": (40, "a cat")}.get(case, (128, "a cat"))
    orch, client = make(EXPAND, None if case == "no tokenizer" else tokenizer, max_model_len=mml)
    body = {"prompt": prompt}
    sync = await client.post("/v1/images/generations", json=body)
    r = await client.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": body})
    if case == "fits":
        assert sync.status_code == 200 and r.status_code == 200, r.text
        assert (await settled(client, r.json()["id"]))["status"] == "completed"
        return
    assert r.status_code == sync.status_code, r.text
    err, want = r.json()["error"], sync.json()["error"]
    assert err["message"] == f"body: {want['message']}" and err["param"] == ("body.prompt" if want["param"] else "body")
    assert orch.requests == [] and (await client.get("/v1/omni/jobs")).json()["data"] == []
