"""`omni serve DIR --api-server-count 2` of the tiny Wan folder: the Videos API on two frontends over one
set of stages. A video made on frontend 0 is read, listed and downloaded on frontend 1, its MP4's frames
equal diffusers' WanPipeline's for the same arguments (the MP4 is lossless), and once deleted on 1 it is
404 on 0 (vllm-omni answers these routes 409 with more than one API server)."""

from __future__ import annotations

import numpy as np
import pytest

from omni.api import mp4
from tests.e2e.harness import OmniProcess, omni_env, omni_shm_entries, pinned
from tests.e2e.test_api_servers import finished_job

pytestmark = [pytest.mark.e2e]
diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

NAME = "tiny-wan"
BODY = {"model": NAME, "prompt": "a red cat on the mountain", "size": "32x32", "num_frames": 5, "fps": 8,
        "num_inference_steps": 2, "seed": 11, "guidance_scale": 5.0, "negative_prompt": "blurry"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni.models.wan.tiny import build

    return build(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="module")
def want(tiny) -> np.ndarray:
    from omni.models.wan.engine import to_uint8

    torch.set_num_threads(1)
    pipe = diffusers.WanPipeline.from_pretrained(str(tiny), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(BODY["prompt"], negative_prompt=BODY["negative_prompt"], guidance_scale=BODY["guidance_scale"],
                  height=32, width=32, num_frames=5, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(BODY["seed"]), output_type="np").frames
    return to_uint8(frames)[0]


@pytest.fixture(scope="module")
def clients(tiny):
    p = OmniProcess("serve", str(tiny), "--port", "0", "--served-model-name", NAME, "--api-server-count", "2",
                    env=omni_env(OMNI_PLATFORM="cpu", OMP_NUM_THREADS="1"))
    a = b = None
    try:
        url = p.http(timeout=300)
        a, b = pinned(url, "0"), pinned(url, "1")
        yield a, b
    finally:
        for c in (a, b):
            if c is not None:
                c.close()
        assert omni_shm_entries(p.stop(60)) == []


def test_a_video_made_on_one_frontend_is_served_and_deleted_by_the_other(clients, want):
    a, b = clients
    r = a.post("/v1/videos", json=BODY)
    assert r.status_code == 200 and r.headers["x-omni-frontend"] == "0", r.text
    video = r.json()
    assert video["object"] == "video" and video["status"] == "queued" and video["model"] == NAME
    assert video["size"] == "32x32" and video["seconds"] == "0.625" and video["num_frames"] == 5
    assert finished_job(b, video["id"], 120)["status"] == "completed"     # a video is a job
    done = b.get(f"/v1/videos/{video['id']}").json()
    assert done["status"] == "completed" and done["progress"] == 100, done
    assert video["id"] in [v["id"] for v in b.get("/v1/videos").json()["data"]]
    content = b.get(f"/v1/videos/{video['id']}/content")
    assert content.status_code == 200 and content.headers["x-omni-frontend"] == "1"
    assert content.headers["content-type"] == "video/mp4"
    frames, fps = mp4.decode(content.content)
    assert fps == 8 and frames.shape == (5, 32, 32, 3)
    assert np.array_equal(frames, want)           # the pipeline's frames, bit for bit
    d = b.delete(f"/v1/videos/{video['id']}")
    assert d.json() == {"id": video["id"], "object": "video.deleted", "deleted": True}
    for path in ("/content", ""):
        r = a.get(f"/v1/videos/{video['id']}{path}")
        err = r.json()["error"]
        assert r.status_code == 404 and err["type"] == "not_found_error" and err["param"] == "video_id", r.text
    assert a.get("/v1/videos").json()["data"] == []


@pytest.mark.parametrize("change, param", [({"size": "40x32"}, "size"), ({"num_frames": 6}, "num_frames"),
                                           ({"num_frames": 21}, "num_frames"), ({"boundary_ratio": 0.9}, "boundary_ratio")])
def test_bad_input_is_refused_by_name_on_either_frontend(clients, change, param):
    for c in clients:
        r = c.post("/v1/videos", json={**BODY, **change})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
