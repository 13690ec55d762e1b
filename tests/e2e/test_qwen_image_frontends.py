"""Issue 26, item 5: `omni serve DIR --api-server-count 2` of the tiny Qwen-Image folder. Both frontends
answer images equal to diffusers' QwenImagePipeline; an image job made on one frontend is listed, read,
downloaded and deleted through the other; a bad job body is the sync route's 400; sleep and wake-up
through either frontend reach the diffusion stage (level 1 refused on CPU, level 2 drops the weights)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.e2e.harness import OmniProcess, omni_env, omni_shm_entries
from tests.e2e.test_api_servers import finished_job, pinned, until_frontend
from tests.e2e.test_qwen_image import NAME, pipe, pixels, reference, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e]
pytest.importorskip("diffusers")

BODY = {"model": NAME, "prompt": "a red cat on the mountain", "size": "64x48", "num_inference_steps": 3,
        "seed": 11, "guidance_scale": 4.0}


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    p = OmniProcess("serve", str(tiny), "--port", "0", "--served-model-name", NAME, "--api-server-count", "2",
                    env=omni_env(OMNI_PLATFORM="cpu", OMP_NUM_THREADS="1"))
    try:
        yield p.http(timeout=300)
    finally:
        assert omni_shm_entries(p.stop(60)) == []


@pytest.fixture(scope="module")
def want(pipe):  # noqa: F811
    return reference(pipe, BODY["prompt"])[0]


@pytest.fixture
def clients(server):
    a, b = pinned(server, "0"), pinned(server, "1")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def image_of(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 1
    return pixels(data[0]["b64_json"])


def test_each_frontend_answers_the_pipelines_image(server, want):
    for index in ("0", "1"):
        r = until_frontend(server, index, "POST", "/v1/images/generations", json=BODY)
        assert np.array_equal(image_of(r), want), index


def test_an_image_job_made_on_one_frontend_is_served_and_deleted_by_the_other(clients, want):
    a, b = clients
    r = a.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": BODY})
    assert r.status_code == 200 and r.headers["x-omni-frontend"] == "0", r.text
    job = r.json()
    assert job["frontend"] == 0 and job["endpoint"] == "/v1/images/generations"
    done = finished_job(b, job["id"])
    assert done["status"] == "completed" and done["content_type"] == "application/json", done
    assert job["id"] in [j["id"] for j in b.get("/v1/omni/jobs").json()["data"]]
    content = b.get(f"/v1/omni/jobs/{job['id']}/content")
    assert content.headers["x-omni-frontend"] == "1" and len(content.content) == done["bytes"]
    assert np.array_equal(image_of(content), want)
    sync = b.post("/v1/images/generations", json=BODY)
    assert content.json()["data"] == sync.json()["data"]     # the same PNG bytes; `created` is each call's time
    d = b.delete(f"/v1/omni/jobs/{job['id']}")
    assert d.json() == {"id": job["id"], "object": "omni.job.deleted", "deleted": True}
    for c in (a, b):
        for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            r = c.request(method, f"/v1/omni/jobs/{job['id']}{path}")
            err = r.json()["error"]
            assert r.status_code == 404 and err["type"] == "not_found_error" and err["param"] == "job_id", r.text
    assert job["id"] not in [j["id"] for j in a.get("/v1/omni/jobs").json()["data"]]


@pytest.mark.parametrize("change, param", [({"size": "60x48"}, "size"), ({"quality": "hd"}, "quality"),
                                           ({"n": 5}, "n"), ({"model": "nope"}, "model")])
def test_a_bad_image_job_is_the_sync_routes_refusal_on_either_frontend(clients, change, param):
    body = {**BODY, **change}
    for c in clients:
        sync = c.post("/v1/images/generations", json=body)
        job = c.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": body})
        assert sync.status_code in (400, 404) and job.status_code == sync.status_code, job.text
        err = job.json()["error"]
        assert err["param"] == f"body.{param}" and err["message"] == f"body: {sync.json()['error']['message']}"


def test_sleep_and_wakeup_through_either_frontend_reach_the_diffusion_stage(clients, want):
    a, b = clients
    for c in (a, b):   # each frontend's command reaches the stage, and its refusal comes back
        r = c.post("/v1/omni/sleep", json={"level": 1})
        assert r.status_code == 409 and "stage 0" in r.json()["error"]["message"], r.text   # its only replica refused
        [result] = r.json()["results"]
        assert not result["ok"] and "on CPU cannot sleep at level 1" in result["message"], result
        assert result["stage_id"] == 0 and r.json()["is_sleeping"] is False

    r = a.post("/v1/omni/sleep", json={"level": 2})
    assert r.status_code == 200 and [x["ok"] for x in r.json()["results"]] == [True], r.text
    assert b.get("/v1/omni/is_sleeping").json() == {"is_sleeping": True}
    refused = b.post("/v1/images/generations", json=BODY)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"], refused.text
    assert "wakeup" in refused.json()["error"]["message"]
    job = b.post("/v1/omni/jobs", json={"endpoint": "/v1/images/generations", "body": BODY}).json()
    failed = finished_job(a, job["id"])
    assert failed["status"] == "failed" and "asleep" in failed["error"]["message"], failed
    assert a.delete(f"/v1/omni/jobs/{job['id']}").status_code == 200

    r = b.post("/v1/omni/wakeup")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False, r.text
    assert a.get("/v1/omni/is_sleeping").json() == {"is_sleeping": False}
    assert np.array_equal(image_of(a.post("/v1/images/generations", json=BODY)), want)
