"""vllm-omni's and vLLM's HTTP endpoints omni does not serve are a 404 `endpoint_not_supported` naming the
endpoint and what to use instead, for every method; they were a bare 'Not Found' (code null), and
POST /v1/videos/sync (vllm-omni's blocking video generation) a 405 from /v1/videos/{video_id}."""

from __future__ import annotations

import pytest

from omni.api import unsupported
from omni.api.routes import ROUTES, label, openapi_spec
from omni.config import VideoSettings
from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
VIDEOS = VideoSettings(default_size="48x32", max_pixels=64 * 64, default_steps=7, max_steps=20, default_frames=5,
                       max_frames=9, default_fps=8, max_fps=30)


def test_no_refused_path_is_served_or_described():
    served = {r.path for r in ROUTES}
    assert not served & set(unsupported.NOT_SERVED)
    assert not set(openapi_spec("tiny")["paths"]) & set(unsupported.NOT_SERVED)
    # nor counted on /metrics as a served route (it was /v1/videos/{video_id}'s)
    assert label("/v1/videos/sync") == "other" and label("/v1/videos/video_1") == "/v1/videos/{video_id}"


async def test_videos_sync_is_refused_by_name_and_a_video_id_still_routes(tokenizer):  # noqa: F811
    _, c = make(tokenizer, videos=VIDEOS)
    for method in ("POST", "GET", "DELETE"):
        err = assert_error(await c.request(method, "/v1/videos/sync", json={"prompt": "a cat"}), 404)
        assert err["code"] == "endpoint_not_supported", err
        assert err["message"].startswith("/v1/videos/sync: blocking video generation is not supported")
        assert "POST /v1/videos, then GET /v1/videos/{video_id}/content" in err["message"]
    for method in ("GET", "DELETE"):   # the route of a video id answers as before
        err = assert_error(await c.request(method, "/v1/videos/video_0123"), 404, param="video_id")
        assert err["code"] != "endpoint_not_supported"
    assert (await c.get("/v1/videos")).status_code == 200


@pytest.mark.parametrize("path, why", [
    ("/v1/audio/speech/batch", "/v1/omni/jobs"),
    ("/v1/chat/completions/batch", "one request per input"),
    ("/v1/images/edits", "/v1/images/generations only"),
    ("/v1/responses", "/v1/chat/completions"),
    ("/v1/messages/count_tokens", "/tokenize"),
    ("/v1/audio/transcriptions", "input_audio"),
    ("/v1/embeddings", "pooling models"),
    ("/pooling", "pooling models"),
    ("/v2/rerank", "pooling models"),
    ("/pause", "/v1/omni/sleep"),
    ("/v1/load_lora_adapter", "no LoRA adapters"),
    ("/start_profile", "--profiler-config"),
    ("/invocations", "SageMaker"),
])
async def test_vllm_endpoints_omni_lacks_are_refused_by_name(tokenizer, path, why):  # noqa: F811
    _, c = make(tokenizer)
    for method in ("GET", "POST"):
        err = assert_error(await c.request(method, path, json={}), 404)
        assert err["code"] == "endpoint_not_supported" and err["type"] == "not_found_error", err
        assert err["message"].startswith(f"{path}: ") and why in err["message"], err
    err = assert_error(await c.post("/v1/no/such/path"), 404)    # an unknown path stays a plain 404
    assert err["code"] != "endpoint_not_supported"
