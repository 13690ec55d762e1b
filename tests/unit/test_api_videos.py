"""The Videos API (/v1/videos) against an in-memory fake orchestrator, two frontends over one KV store and
one result directory: what the stage is asked for (defaults under the client's values), the video object,
the MP4 (lossless: its frames are the stage's), every refusal naming its parameter, and a deleted video's
404 on the other frontend."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import numpy as np
import pytest

from omni.api import build_app, mp4
from omni.api.jobs import Jobs, LocalKv, Results
from omni.config import VideoSettings
from omni.api.protocol_media import MAX_IMAGE_PROMPT_CHARS
from omni.errors import StageFailed
from omni.master.kv import KvStore, Limits
from omni.orchestrator.types import PipelineOutput, PipelineRequest
from tests.unit.test_jobs import settle

pytestmark = pytest.mark.anyio
SETTINGS = VideoSettings(default_size="48x32", max_pixels=64 * 64, default_steps=7, max_steps=20, default_frames=5,
                         max_frames=9, default_fps=8, max_fps=30)


def frames_for(p) -> np.ndarray:
    rng = np.random.default_rng(p.seed % 1000)
    return rng.integers(0, 256, (p.n, p.num_frames, p.height, p.width, 3), dtype=np.uint8)


class FakeVideos:
    """Answers a video request with seeded noise frames of the asked shape."""

    def __init__(self):
        self.requests: list[PipelineRequest] = []
        self.fail: Exception | None = None

    async def generate(self, request: PipelineRequest):
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        rows = frames_for(request.image)
        yield PipelineOutput(request_id=request.request_id, stage_id=0, modality="video", finished=True,
                             image=rows.tobytes(), image_shape=rows.shape)

    def health(self):
        return True, ""


class MasterKv(LocalKv):
    """The master's own store behind the client's calls: its value cap and checks."""

    def __init__(self):
        self.store = KvStore()

    async def kv_put(self, namespace, key, value, only_if_exists=False):
        return self.store.put(namespace, key, value, only_if_exists)

    async def kv_get(self, namespace, key):
        return self.store.get(namespace, key)

    async def kv_list(self, namespace, prefix="", max_entries=100_000, start_after=""):
        return self.store.list(namespace, prefix, max_entries, start_after)[0]

    async def kv_delete(self, namespace, key):
        return self.store.delete(namespace, key)


def frontend(kv, results, index=0, videos: VideoSettings | None = SETTINGS):
    orch = FakeVideos()
    jobs = Jobs(kv, Results(results), frontend_index=index, host=f"h{index}")
    app = build_app(orch, None, served_model_name="wan", max_model_len=16, frontend_index=index, jobs=jobs,
                    videos=videos)
    return orch, jobs, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
def two(tmp_path):
    kv = LocalKv()
    return frontend(kv, tmp_path, 0), frontend(kv, tmp_path, 1)


async def test_a_video_made_on_one_frontend_is_listed_read_downloaded_and_deleted_on_the_other(two):
    (orch, jobs0, c0), (_, _, c1) = two
    r = await c0.post("/v1/videos", json={"prompt": "a cat", "seed": 5, "num_frames": 9, "fps": 12})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["object"] == "video" and v["id"].startswith("video_") and v["status"] == "queued"
    assert v["model"] == "wan" and v["size"] == "48x32" and v["seconds"] == "0.75" and v["progress"] == 0
    await settle(jobs0)
    p = orch.requests[0].image
    assert orch.requests[0].modalities == ("video",) and orch.requests[0].text == "a cat"
    assert (p.width, p.height, p.num_frames, p.num_inference_steps, p.guidance_scale, p.negative_prompt, p.seed) == \
        (48, 32, 9, 7, 5.0, "", 5)
    got = (await c1.get(f"/v1/videos/{v['id']}")).json()
    assert got["status"] == "completed" and got["progress"] == 100 and got["completed_at"] is not None
    listed = (await c1.get("/v1/videos")).json()
    assert [x["id"] for x in listed["data"]] == [v["id"]] and listed["first_id"] == v["id"]
    r = await c1.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    frames, fps = mp4.decode(r.content)
    assert fps == 12 and np.array_equal(frames, frames_for(p)[0])      # lossless
    d = await c1.delete(f"/v1/videos/{v['id']}")
    assert d.json() == {"id": v["id"], "object": "video.deleted", "deleted": True}
    for path in (f"/v1/videos/{v['id']}/content", f"/v1/videos/{v['id']}"):
        r = await c0.get(path)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": f"video `{v['id']}` does not exist", "type": "not_found_error",
                                     "param": "video_id", "code": "video_not_found"}
    assert (await c0.get("/v1/videos")).json()["data"] == []


async def test_a_form_like_openais_sdk_sends_and_seconds_at_fps(two):
    (orch, jobs0, c0), _ = two
    r = await c0.post("/v1/videos", files={"prompt": (None, "a dog"), "seconds": (None, "1"), "size": (None, "32x32"),
                                           "fps": (None, "8"), "seed": (None, "3")})
    assert r.status_code == 200, r.text
    await settle(jobs0)
    p = orch.requests[0].image
    assert (p.width, p.height, p.num_frames, p.seed) == (32, 32, 9, 3)     # 1 s x 8 fps -> 4k + 1 = 9
    r = await c0.post("/v1/videos", files={"prompt": (None, "x"), "input_reference": ("a.png", b"png")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


@pytest.mark.parametrize("send, says", [
    ({"content": b"prompt", "headers": {"content-type": "multipart/form-data"}}, "Missing boundary"),
    ({"files": {"prompt": (None, "a" * (1024 * 1024 + 1))}}, "Part exceeded maximum size"),
    ({"content": "&".join(f"f{i}=1" for i in range(1001)).encode(),
      "headers": {"content-type": "application/x-www-form-urlencoded"}}, "Too many fields"),
], ids=["no-boundary", "part-over-1mb", "1001-fields"])
async def test_a_form_starlette_cannot_read_is_a_400_with_its_reason(two, send, says):
    (orch, _, c0), _ = two
    r = await c0.post("/v1/videos", **send)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and "the form cannot be read" in e["message"] and says in e["message"]
    assert orch.requests == []


@pytest.mark.parametrize("send", [
    {"data": {"prompt": ["a cat", "a dog"], "seed": "1"}},
    {"files": [("prompt", (None, "a cat")), ("prompt", (None, "a dog"))]},
], ids=["urlencoded", "multipart"])
async def test_a_form_field_sent_twice_is_refused_by_name(two, send):
    (orch, _, c0), _ = two
    r = await c0.post("/v1/videos", **send)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "sent twice" in r.json()["error"]["message"] and orch.requests == []


async def test_a_download_streams_the_result_file_and_never_follows_a_symlink(two, tmp_path, monkeypatch):
    """The MP4 is served from its file (FileResponse: Range requests work, nothing reads it whole); a result
    replaced by a symlink (to a file outside the folder) or gone is a 404."""
    (orch, jobs0, c0), (_, _, c1) = two
    v = (await c0.post("/v1/videos", json={"prompt": "a cat", "num_frames": 9})).json()
    await settle(jobs0)
    whole = (tmp_path / v["id"]).read_bytes()

    def no_whole_reads(*a, **k):
        raise AssertionError("the result was read whole into memory")

    monkeypatch.setattr(Results, "get", no_whole_reads)
    r = await c1.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 200 and r.content == whole and r.headers["content-type"] == "video/mp4"
    assert r.headers["content-length"] == str(len(whole)) and r.headers["accept-ranges"] == "bytes"
    r = await c1.get(f"/v1/videos/{v['id']}/content", headers={"range": "bytes=4-11"})
    assert r.status_code == 206 and r.content == whole[4:12]
    outside = tmp_path.parent / f"{tmp_path.name}-secret"
    outside.write_bytes(b"not a video of this folder")
    (tmp_path / v["id"]).unlink()
    (tmp_path / v["id"]).symlink_to(outside)
    r = await c1.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 404 and b"not a video" not in r.content and "gone" in r.json()["error"]["message"]
    (tmp_path / v["id"]).unlink()
    assert (await c0.get(f"/v1/videos/{v['id']}/content")).status_code == 404


async def test_a_failed_video_reads_failed_and_its_content_is_409(two):
    (orch, jobs0, c0), (_, _, c1) = two
    orch.fail = StageFailed("dit", "denoise", "boom")
    v = (await c0.post("/v1/videos", json={"prompt": "a cat"})).json()
    await settle(jobs0)
    got = (await c1.get(f"/v1/videos/{v['id']}")).json()
    assert got["status"] == "failed" and "boom" in got["error"]["message"]
    r = await c1.get(f"/v1/videos/{v['id']}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_completed"


async def test_list_pages_with_limit_order_and_after(two):
    (_, jobs0, c0), (_, _, c1) = two
    ids = [(await c0.post("/v1/videos", json={"prompt": f"p{i}"})).json()["id"] for i in range(3)]
    await settle(jobs0)
    page = (await c1.get("/v1/videos", params={"limit": 2})).json()
    assert [v["id"] for v in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = (await c1.get("/v1/videos", params={"limit": 2, "after": page["last_id"]})).json()
    assert [v["id"] for v in rest["data"]] == [ids[0]] and not rest["has_more"]
    asc = (await c1.get("/v1/videos", params={"order": "asc"})).json()
    assert [v["id"] for v in asc["data"]] == ids
    r = await c1.get("/v1/videos", params={"limit": 2, "before": ids[0]})     # not OpenAI's: refused, not ignored
    assert r.status_code == 400 and r.json()["error"]["param"] == "before"
    # a generic job is no video, a video is a job
    assert (await c1.get(f"/v1/omni/jobs/{ids[0]}")).json()["endpoint"] == "/v1/videos"


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "x", "size": "40x32"}, "size", "multiples of 16"),
    ({"prompt": "x", "width": 128, "height": 128}, "width", "pixels; the limit is 4096"),
    ({"prompt": "x", "width": 32}, "height", "come together"),
    ({"prompt": "x", "size": "32x32", "width": 32, "height": 32}, "size", "not both"),
    ({"prompt": "x", "num_frames": 6}, "num_frames", "1 more than a multiple of 4"),
    ({"prompt": "x", "num_frames": 13}, "num_frames", "the limit is 9 (max_frames)"),
    ({"prompt": "x", "seconds": 5}, "seconds", "the limit is 9"),
    ({"prompt": "x", "seconds": 1, "num_frames": 5}, "seconds", "not both"),
    ({"prompt": "x", "fps": 31}, "fps", "the limit is 30"),
    ({"prompt": "x", "num_inference_steps": 21}, "num_inference_steps", "the limit is 20"),
    ({"prompt": "x", "guidance_scale": 1.0, "negative_prompt": "y"}, "negative_prompt", "needs guidance"),
    ({"prompt": " "}, "prompt", "some text"),
    ({"prompt": "x", "model": "sora-2"}, "model", "does not exist"),
    ({"prompt": "x", "guidance_scale_2": 3.0}, "guidance_scale_2", "unknown field"),
    ({"prompt": "x", "input_reference": "a.png"}, "input_reference", "unknown field"),
])
async def test_bad_input_is_refused_naming_the_parameter(two, body, param, says):
    (orch, _, c0), _ = two
    r = await c0.post("/v1/videos", json=body)
    assert r.status_code in (400, 404), r.text
    e = r.json()["error"]
    assert e["param"] == param and says in e["message"], e
    assert orch.requests == [] and (await c0.get("/v1/videos")).json()["data"] == []


async def test_a_side_past_the_models_position_table_is_a_400_naming_size(tmp_path):
    """A side over max_side (the DiT's rotary table: Wan's 1024 positions x 16 px) is refused here: at the
    stage its forward failed, and with it every video the stage held."""
    orch, _, c = frontend(LocalKv(), tmp_path, videos=VideoSettings())     # the defaults: 16384 a side
    r = await c.post("/v1/videos", json={"prompt": "x", "size": "16400x48"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    assert "a side is at most 16384 pixels" in r.json()["error"]["message"]
    small = VideoSettings(default_size="32x32", max_pixels=1 << 20, max_side=1024, default_frames=5, max_frames=9)
    orch, jobs, c = frontend(LocalKv(), tmp_path, videos=small)
    r = await c.post("/v1/videos", json={"prompt": "x", "width": 16, "height": 1040})
    assert r.status_code == 400 and r.json()["error"]["param"] == "width", r.text
    r = await c.post("/v1/videos", data={"prompt": "x", "size": "1040x16"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    assert orch.requests == []
    assert (await c.post("/v1/videos", json={"prompt": "x", "size": "1024x16"})).status_code == 200
    await settle(jobs)
    assert (orch.requests[0].image.width, orch.requests[0].image.height) == (1024, 16)


@pytest.mark.parametrize("char", ["\U0001F600", "\x01", "\u00e9"], ids=["emoji", "control", "accent"])
async def test_the_largest_video_record_fits_the_kv_value_cap(tmp_path, char):
    """The record keeps the prompt and negative prompt (MAX_IMAGE_PROMPT_CHARS each, whatever the deployment
    says): stored as UTF-8 JSON a character takes at most 6 bytes (a control character's \\u00XX; 4 in UTF-8),
    the rest of the record under 2 KB. ASCII-escaped an emoji took 12: 96 KB, a 400 naming the KV's limit."""
    cap = KvStore().limits("jobs").max_value_bytes
    assert 2 * MAX_IMAGE_PROMPT_CHARS * 6 + 2048 <= cap
    kv = MasterKv()
    orch, jobs, c = frontend(kv, tmp_path, videos=VideoSettings(max_prompt_chars=10**6, default_size="16x16",
                                                                   default_frames=1, max_frames=1))
    text = char * MAX_IMAGE_PROMPT_CHARS
    r = await c.post("/v1/videos", json={"prompt": text, "negative_prompt": text, "model": "wan", "seed": 2**63 - 1,
                                         "guidance_scale": 50.0, "num_inference_steps": 100, "fps": 60})
    assert r.status_code == 200, r.text[:300]
    await settle(jobs)
    v = (await c.get(f"/v1/videos/{r.json()['id']}")).json()
    assert v["status"] == "completed" and v["prompt"] == v["negative_prompt"] == text and orch.requests[0].text == text
    blob = kv.store.get("jobs", v["id"])
    assert len(blob) - 2 * len(json.dumps(text, ensure_ascii=False).encode()) < 2048


class GatedKv(LocalKv):
    """Holds the write of a record of status `hold` until `gate` is set: a master round trip under load, while
    another frontend's DELETE lands (the run had read the record, or checks nothing, before writing)."""

    def __init__(self, hold: str):
        super().__init__()
        self.hold, self.held, self.gate = hold, asyncio.Event(), asyncio.Event()

    async def kv_put(self, namespace, key, value, **kw):
        if json.loads(value).get("status") == self.hold:
            self.held.set()
            await self.gate.wait()
        return await super().kv_put(namespace, key, value, **kw)


@pytest.mark.parametrize("hold", ["in_progress", "completed"])
async def test_a_delete_between_a_runs_read_and_write_stays_deleted(tmp_path, hold):
    """The master's KV had no conditional write: a DELETE landing while the run wrote `in_progress` (or its
    final record) was undone by that write, and the video came back and ran to completion. Now both writes
    are only-if-exists: the video stays deleted, never runs (in_progress) and leaves no result file."""
    kv = GatedKv(hold)
    orch, jobs0, c0 = frontend(kv, tmp_path, 0)
    _, _, c1 = frontend(kv, tmp_path, 1)
    v = (await c0.post("/v1/videos", json={"prompt": "a cat"})).json()
    await asyncio.wait_for(kv.held.wait(), 10)
    assert (await c1.delete(f"/v1/videos/{v['id']}")).status_code == 200
    kv.gate.set()
    await settle(jobs0)
    for c in (c0, c1):
        assert (await c.get(f"/v1/videos/{v['id']}")).status_code == 404
        assert (await c.get("/v1/videos")).json()["data"] == []
    assert len(orch.requests) == (0 if hold == "in_progress" else 1)
    assert os.listdir(tmp_path) == [] and await kv.kv_get("jobs", v["id"]) is None


async def test_no_video_stage_is_404_and_other_ids_are_no_videos(tmp_path):
    _, _, c = frontend(LocalKv(), tmp_path, videos=None)
    r = await c.post("/v1/videos", json={"prompt": "x"})
    assert r.status_code == 404 and "makes no videos" in r.json()["error"]["message"]
    _, _, c = frontend(LocalKv(), tmp_path)
    for vid in ("job-" + "0" * 32, "video_nope", "video_" + "0" * 32):
        assert (await c.get(f"/v1/videos/{vid}")).status_code == 404
    assert (await c.get("/v1/videos/video_x/content", params={"variant": "thumbnail"})).status_code == 400


async def test_deleting_a_running_video_cancels_it(two):
    (orch, jobs0, c0), (_, _, c1) = two
    started, gate = asyncio.Event(), asyncio.Event()

    async def slow(request):
        started.set()
        await gate.wait()
        yield  # pragma: no cover

    orch.generate = slow
    v = (await c0.post("/v1/videos", json={"prompt": "x"})).json()
    task = jobs0._tasks[v["id"]]
    await asyncio.wait_for(started.wait(), 10)
    assert (await c1.get(f"/v1/videos/{v['id']}")).json()["status"] == "in_progress"
    assert (await c1.delete(f"/v1/videos/{v['id']}")).status_code == 200
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)   # the watcher cancels it
    assert task.cancelled() and (await c0.get(f"/v1/videos/{v['id']}")).status_code == 404


async def test_a_video_deleted_before_it_starts_stays_deleted(two):
    (orch, jobs0, c0), (_, _, c1) = two
    v = (await c0.post("/v1/videos", json={"prompt": "x"})).json()
    assert (await c1.delete(f"/v1/videos/{v['id']}")).status_code == 200     # before its task first ran
    await settle(jobs0)
    assert orch.requests == [] and (await c0.get(f"/v1/videos/{v['id']}")).status_code == 404


@pytest.mark.parametrize("kind", ["video", "job"])
@pytest.mark.parametrize("ends", ["completed", "failed"])
@pytest.mark.parametrize("full", ["while running", "before it starts"])
async def test_a_job_whose_end_the_full_namespace_refuses_reads_failed_on_every_frontend(tmp_path, kind, ends, full):
    """The final record is larger than the queued/in_progress one, so a jobs namespace filled to its cap
    meanwhile refused it, and the 'plain failure' put in its place (larger still): the job read in_progress for
    7 days on the other frontends and 'frontend gone' on its own. The fallback is now no larger than the
    record the master holds."""
    kv = MasterKv()
    fronts = [Jobs(kv, Results(tmp_path), frontend_index=i, host=f"h{i}",
                   live_frontends=lambda: {("h0", os.getpid()), ("h1", os.getpid())}) for i in (0, 1)]
    started, gate = asyncio.Event(), asyncio.Event()

    async def work():
        started.set()
        await gate.wait()
        if ends == "completed":
            return 200, "video/mp4", b"\0" * 1000
        return 500, "application/json", json.dumps({"error": {"message": "e" * 3000, "type": "stage_error"}}).encode()

    extra = {"video": {"prompt": "a cat", "negative_prompt": None}} if kind == "video" else None
    job = await fronts[0].submit("/v1/videos", work, prefix="video_" if kind == "video" else "job-", extra=extra)
    if full == "while running":
        await asyncio.wait_for(started.wait(), 10)
    # other clients' jobs filled the namespace: its cap is what it holds now
    kv.store._limits["jobs"] = Limits(ttl_s=7 * 86400.0, max_bytes=kv.store._bytes["jobs"])
    gate.set()
    await settle(fronts[0])
    for jobs in fronts:
        got = await jobs.record(job["id"])
        assert got["status"] == "failed" and got["error"]["code"] == "record_refused", (jobs.frontend_index, got)
        assert "refused its final record" in got["error"]["message"]
    assert os.listdir(tmp_path) == []     # no result without a record saying completed
    for jobs in fronts:
        await jobs.close()
