"""Async jobs (/v1/omni/jobs) against the fake orchestrator, with an in-memory KV shared by two frontends."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from omni.api import build_app
from omni.api.jobs import Jobs, LocalKv, Results
from omni.errors import StageFailed, Unavailable
from omni.voices import MasterVoiceStore
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio

SPEECH = {"model": "tiny", "input": "Hello there.", "voice": "joe"}


def frontend(tokenizer, kv, results_dir, index=0, host="h0", live=None, **kw):
    orch = FakeOrchestrator(tokenizer)
    orch.audio_chunks = 3
    jobs = Jobs(kv, Results(results_dir), frontend_index=index, host=host, live_frontends=live)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    frontend_index=index, jobs=jobs, **kw)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return orch, jobs, client


async def settle(jobs: Jobs, timeout: float = 10.0) -> None:
    """Wait (bounded) until every job this frontend runs has finished."""
    tasks = list(jobs._tasks.values())
    if tasks:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)


async def test_speech_job_lifecycle_matches_the_sync_answer(tokenizer, tmp_path):
    _, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": SPEECH})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "omni.job" and job["id"].startswith("job-") and job["status"] == "queued"
    assert job["endpoint"] == "/v1/audio/speech" and job["frontend"] == 0 and job["error"] is None
    assert "owner" not in job and "created_ns" not in job
    await settle(jobs)
    got = (await c.get(f"/v1/omni/jobs/{job['id']}")).json()
    sync = await c.post("/v1/audio/speech", json=SPEECH)
    assert got["status"] == "completed" and got["completed_at"] >= got["created_at"]
    assert got["content_type"] == "audio/wav" and got["bytes"] == len(sync.content)
    content = await c.get(f"/v1/omni/jobs/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "audio/wav"
    assert content.content == sync.content and content.content[:4] == b"RIFF"
    # The result is one file in the shared directory, no temp files left behind.
    assert os.listdir(tmp_path) == [job["id"]]
    listed = (await c.get("/v1/omni/jobs")).json()
    assert listed["object"] == "list" and [j["id"] for j in listed["data"]] == [job["id"]]
    d = await c.delete(f"/v1/omni/jobs/{job['id']}")
    assert d.json() == {"id": job["id"], "object": "omni.job.deleted", "deleted": True}
    assert os.listdir(tmp_path) == []
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        err = assert_error(await c.request(method, f"/v1/omni/jobs/{job['id']}{path}"), 404, param="job_id")
        assert err["type"] == "not_found_error"


async def test_chat_job_content_has_the_sync_shape(tokenizer, tmp_path):
    _, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    job = (await c.post("/v1/omni/jobs", json={"endpoint": "/v1/chat/completions",
                                              "body": chat_body(temperature=0)})).json()
    await settle(jobs)
    content = await c.get(f"/v1/omni/jobs/{job['id']}/content")
    sync = (await c.post("/v1/chat/completions", json=chat_body(temperature=0))).json()
    got = content.json()
    assert content.headers["content-type"] == "application/json"
    assert set(got) == set(sync) and got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["content"] == sync["choices"][0]["message"]["content"] == "hello world"
    assert got["usage"] == sync["usage"]


async def test_list_is_newest_first_with_limit(tokenizer, tmp_path):
    _, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    ids = []
    for _ in range(3):
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": "tiny", "prompt": "hello"}})
        ids.append(r.json()["id"])
    await settle(jobs)
    listed = (await c.get("/v1/omni/jobs?limit=2")).json()
    assert [j["id"] for j in listed["data"]] == ids[::-1][:2] and listed["has_more"] is True
    assert all(j["status"] == "completed" for j in listed["data"])
    assert_error(await c.get("/v1/omni/jobs?limit=0"), 400, param="limit")
    assert_error(await c.get("/v1/omni/jobs?limit=x"), 400, param="limit")
    # OpenAI's list parameters page on; they were ignored (`after` gave the first page again)
    rest = (await c.get("/v1/omni/jobs", params={"limit": 2, "after": listed["last_id"]})).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert [j["id"] for j in (await c.get("/v1/omni/jobs?order=asc")).json()["data"]] == ids
    assert_error(await c.get("/v1/omni/jobs?after=job-nope"), 404, param="after")   # schema-valid: not a 400
    assert_error(await c.get("/v1/omni/jobs?status=completed"), 400, param="status")
    assert_error(await c.get("/v1/omni/jobs?limit=1&limit=2"), 400, param="limit")


@pytest.mark.parametrize("body,param,contains", [
    ({"endpoint": "/v1/models", "body": {}}, "endpoint", "/v1/audio/speech"),
    ({"body": SPEECH}, "endpoint", None),
    ({"endpoint": "/v1/audio/speech"}, "body", None),
    ({"endpoint": "/v1/audio/speech", "body": [1]}, "body", None),
    ({"endpoint": "/v1/chat/completions", "body": chat_body(stream=True)}, "body.stream", "stream"),
    ({"endpoint": "/v1/audio/speech", "body": {**SPEECH, "stream_format": "sse"}}, "body.stream_format", "stream"),
    ({"endpoint": "/v1/audio/speech", "body": {**SPEECH, "stream_format": "audio", "response_format": "wav"}},
     "body.stream_format", "stream"),
    ({"endpoint": "/v1/audio/speech", "body": {**SPEECH, "response_format": "pcm"}}, "body.response_format", "wav"),
    ({"endpoint": "/v1/audio/speech", "body": {"model": "tiny"}}, "body.input", "input"),
    ({"endpoint": "/v1/completions", "body": {"prompt": 5}}, "body.prompt", None),
    ({"endpoint": "/v1/audio/speech", "body": SPEECH, "priority": 1}, "priority", "priority"),   # refused, not ignored
])
async def test_bad_job_requests_are_400(tokenizer, tmp_path, body, param, contains):
    _, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    assert_error(await c.post("/v1/omni/jobs", json=body), 400, param=param, contains=contains)
    assert jobs._tasks == {} and (await c.get("/v1/omni/jobs")).json()["data"] == []


async def test_inner_error_is_a_failed_job(tokenizer, tmp_path):
    orch, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    orch.fail = StageFailed(1, "r0", "the talker broke")    # a body the route refuses is a 400 at submit instead
    job = (await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": SPEECH})).json()
    await settle(jobs)
    got = (await c.get(f"/v1/omni/jobs/{job['id']}")).json()
    assert got["status"] == "failed" and "the talker broke" in got["error"]["message"]
    assert got["content_type"] is None and got["completed_at"] is not None
    assert_error(await c.get(f"/v1/omni/jobs/{job['id']}/content"), 409, contains="failed")


async def test_unknown_ids_and_api_key(tokenizer, tmp_path):
    _, _, c = frontend(tokenizer, LocalKv(), tmp_path, api_key="k")
    assert_error(await c.get("/v1/omni/jobs"), 401)
    h = {"Authorization": "Bearer k"}
    assert_error(await c.get("/v1/omni/jobs/job-" + "0" * 32, headers=h), 404, param="job_id")
    assert_error(await c.get("/v1/omni/jobs/..", headers=h), 404)
    assert_error(await c.delete("/v1/omni/jobs/%2e%2e%2fx", headers=h), 404)


async def test_other_frontend_sees_progress_and_owner_death(tokenizer, tmp_path):
    kv, live = LocalKv(), {("h0", os.getpid()), ("h1", os.getpid())}
    orch0, jobs0, c0 = frontend(tokenizer, kv, tmp_path, 0, "h0", lambda: set(live))
    _, _, c1 = frontend(tokenizer, kv, tmp_path, 1, "h1", lambda: set(live))
    orch0.hang_after = 0
    job = (await c0.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": "tiny", "prompt": "hello"}})).json()
    await asyncio.wait_for(orch0.started_event.wait(), 5)
    assert (await c1.get(f"/v1/omni/jobs/{job['id']}")).json()["status"] == "in_progress"
    live.discard(("h0", os.getpid()))   # frontend 0 left the master's topology
    got = (await c1.get(f"/v1/omni/jobs/{job['id']}")).json()
    assert got["status"] == "failed" and got["error"]["code"] == "frontend_gone"
    assert "frontend 0" in got["error"]["message"]
    assert (await c1.get("/v1/omni/jobs")).json()["data"][0]["status"] == "failed"
    assert_error(await c1.get(f"/v1/omni/jobs/{job['id']}/content"), 409, contains="frontend 0")
    await jobs0.close()


async def test_delete_through_another_frontend_cancels_the_running_job(tokenizer, tmp_path):
    kv = LocalKv()
    orch0, jobs0, c0 = frontend(tokenizer, kv, tmp_path, 0, "h0")
    _, _, c1 = frontend(tokenizer, kv, tmp_path, 1, "h1")
    orch0.hang_after = 0
    job = (await c0.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": "tiny", "prompt": "hello"}})).json()
    await asyncio.wait_for(orch0.started_event.wait(), 5)
    assert (await c1.delete(f"/v1/omni/jobs/{job['id']}")).json()["deleted"] is True
    await asyncio.wait_for(orch0.closed_event.wait(), 5)   # frontend 0's watcher cancelled it
    await settle(jobs0)
    assert await kv.kv_get("jobs", job["id"]) is None and os.listdir(tmp_path) == []


class CountingKv(LocalKv):
    """LocalKv that notes each call: (method, key or namespace)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    async def kv_get(self, namespace, key):
        self.calls.append(("kv_get", key))
        return await super().kv_get(namespace, key)

    async def kv_list(self, namespace, prefix="", **kw):
        self.calls.append(("kv_list", namespace))
        return await super().kv_list(namespace, prefix, **kw)


async def test_the_deletion_watcher_reads_its_running_jobs_records_only(tokenizer, tmp_path, monkeypatch):
    """It listed the whole jobs namespace, values included, every 0.5 s (up to 64 MiB a frontend)."""
    import omni.api.jobs as jobs_module

    monkeypatch.setattr(jobs_module, "WATCH_S", 0.01)
    kv = CountingKv()
    for i in range(20):    # other frontends' jobs: none of the watcher's business
        await kv.kv_put("jobs", f"job-{i:032x}", json.dumps({"id": f"job-{i:032x}", "status": "queued"}).encode())
    orch0, jobs0, c0 = frontend(tokenizer, kv, tmp_path, 0, "h0")
    _, _, c1 = frontend(tokenizer, kv, tmp_path, 1, "h1")
    orch0.hang_after = 0
    job = (await c0.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": "tiny", "prompt": "hello"}})).json()
    await asyncio.wait_for(orch0.started_event.wait(), 5)
    kv.calls.clear()
    await asyncio.sleep(0.1)
    assert len(kv.calls) >= 3 and set(kv.calls) == {("kv_get", job["id"])}, kv.calls[:5]
    assert (await c1.delete(f"/v1/omni/jobs/{job['id']}")).json()["deleted"] is True
    await asyncio.wait_for(orch0.closed_event.wait(), 5)   # still seen, and cancelled
    await settle(jobs0)
    assert await kv.kv_get("jobs", job["id"]) is None


async def test_delete_on_the_owner_cancels_at_once(tokenizer, tmp_path):
    orch, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    orch.hang_after = 0
    job = (await c.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                              "body": {"model": "tiny", "prompt": "hello"}})).json()
    await asyncio.wait_for(orch.started_event.wait(), 5)
    await c.delete(f"/v1/omni/jobs/{job['id']}")
    await settle(jobs)
    assert orch.closed == [orch.requests[0].request_id] and jobs._tasks == {}


async def test_a_job_deleted_while_its_result_is_written_leaves_no_result_file(tmp_path, monkeypatch):
    entered, release, wrote = threading.Event(), threading.Event(), threading.Event()
    real_write = Results._write

    def write(self, job_id, data):
        entered.set()
        try:
            assert release.wait(10)
            real_write(self, job_id, data)
        finally:
            wrote.set()
    monkeypatch.setattr(Results, "_write", write)
    jobs = Jobs(LocalKv(), Results(tmp_path))

    async def work():
        return 200, "audio/wav", b"RIFF"
    job = await jobs.submit("/v1/audio/speech", work)
    task = jobs._tasks[job["id"]]
    assert await asyncio.to_thread(entered.wait, 10)
    await jobs.remove(job["id"])          # cancels the job while its result file is being written
    release.set()
    assert await asyncio.to_thread(wrote.wait, 10)
    await asyncio.wait([task], timeout=10)
    assert task.cancelled()
    assert os.listdir(tmp_path) == [] and await jobs.kv.kv_get("jobs", job["id"]) is None
    await jobs.close()


async def test_a_frontend_runs_at_most_max_running_jobs_at_once(tokenizer, tmp_path):
    """A burst of jobs waits "queued" instead of filling the stages ahead of interactive requests."""
    from omni.api.jobs import MAX_RUNNING

    orch, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    orch.hang_after = 0
    ids = [(await c.post("/v1/omni/jobs", json={"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}}
                         )).json()["id"] for _ in range(MAX_RUNNING + 1)]

    async def started(n):
        while len(orch.requests) < n:
            await asyncio.sleep(0)   # yield to the job tasks; bounded by wait_for
    await asyncio.wait_for(started(MAX_RUNNING), 5)
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(orch.requests) == MAX_RUNNING
    statuses = [(await c.get(f"/v1/omni/jobs/{i}")).json()["status"] for i in ids]
    assert statuses == ["in_progress"] * MAX_RUNNING + ["queued"]
    await c.delete(f"/v1/omni/jobs/{ids[0]}")    # frees a slot: the queued job starts
    await asyncio.wait_for(started(MAX_RUNNING + 1), 5)
    await jobs.close()


async def test_a_frontend_holds_at_most_max_queued_waiting_jobs(tokenizer, tmp_path):
    """Each waiting job keeps its body: past the bound a job is a 429 naming it, until one ends."""
    from omni.api.jobs import MAX_QUEUED, MAX_RUNNING

    orch, jobs, c = frontend(tokenizer, LocalKv(), tmp_path)
    orch.hang_after = 0       # the handler never returns
    job = {"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}}
    ids = []
    for _ in range(MAX_RUNNING + MAX_QUEUED):
        r = await c.post("/v1/omni/jobs", json=job)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    err = assert_error(await c.post("/v1/omni/jobs", json=job), 429, contains=f"{MAX_QUEUED} queued")
    assert err["code"] == "too_many_jobs" and len(jobs._tasks) == MAX_RUNNING + MAX_QUEUED
    queued = jobs._tasks[ids[-1]]
    assert (await c.delete(f"/v1/omni/jobs/{ids[-1]}")).status_code == 200
    await asyncio.wait([queued], timeout=5)
    assert queued.done()
    assert (await c.post("/v1/omni/jobs", json=job)).status_code == 200     # room again
    await jobs.close()


async def test_results_whose_records_are_gone_are_swept(tokenizer, tmp_path):
    """The master expires job records after 7 days; their result files went nowhere."""
    kv = LocalKv()
    _, jobs, c = frontend(tokenizer, kv, tmp_path)
    ids = [(await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": SPEECH})).json()["id"]
           for _ in range(2)]
    await settle(jobs)
    await kv.kv_delete("jobs", ids[0])            # as the master's expiry does
    orphan = "job-" + "e" * 32
    (tmp_path / orphan).write_bytes(b"left by a frontend that was down at its delete")
    (tmp_path / ".job-x.tmp").write_bytes(b"a write under way")
    assert sorted(await jobs.sweep()) == sorted([ids[0], orphan])
    assert sorted(os.listdir(tmp_path)) == [".job-x.tmp", ids[1]]
    assert (await c.get(f"/v1/omni/jobs/{ids[1]}/content")).status_code == 200


async def test_the_sweep_removes_temp_files_of_writes_that_never_ended(tmp_path, monkeypatch):
    """A frontend killed while writing a result left `.<id>.<random>.tmp` for good. The sweep removes those
    over an hour old, never a fresh one (a write under way elsewhere) nor one of a job this frontend holds."""
    import omni.fsutil

    kv, results = LocalKv(), Results(tmp_path)
    jobs = Jobs(kv, results)
    old, fresh, mine = ("job-" + c * 32 for c in "abc")
    stale = tmp_path / f".{old}.x1y2.tmp"
    stale_video = tmp_path / f".video_{'d' * 32}.q_9z.tmp"
    for p in (stale, stale_video, tmp_path / f".{fresh}.k3.tmp", tmp_path / f".{mine}.k4.tmp",
              tmp_path / ".other.tmp", tmp_path / "notes.tmp"):
        p.write_bytes(b"half a result")
    two_hours_ago = time.time() - 7200
    for p in tmp_path.iterdir():
        if p.name != f".{fresh}.k3.tmp":
            os.utime(p, (two_hours_ago, two_hours_ago))
    jobs._mine.add(mine)
    await jobs.sweep()
    assert sorted(os.listdir(tmp_path)) == sorted([f".{fresh}.k3.tmp", f".{mine}.k4.tmp", ".other.tmp", "notes.tmp"])
    # the names atomic_write gives its temp files are the ones swept
    from omni.api.job_store import TEMP_RE

    made, real = [], omni.fsutil.tempfile.mkstemp
    monkeypatch.setattr(omni.fsutil.tempfile, "mkstemp", lambda **kw: made.append(real(**kw)) or made[-1])
    omni.fsutil.atomic_write(tmp_path / old, b"x")
    assert TEMP_RE.match(os.path.basename(made[0][1])).group(1) == old


@pytest.mark.parametrize("on_disk", [True, False])
async def test_a_starting_frontend_sweeps_results_without_records(tmp_path, on_disk):
    kv, results = LocalKv(), Results(tmp_path if on_disk else None)
    kept, orphan = "job-" + "a" * 32, "video_" + "b" * 32
    await kv.kv_put("jobs", kept, b"{}")
    for job_id in (kept, orphan):
        await results.put(job_id, b"bytes")
    jobs = Jobs(kv, results)
    await jobs.start()
    assert await results.ids() == [kept] and await results.get(orphan) is None
    await jobs.close()


class DownKv(LocalKv):
    async def kv_put(self, *a, **kw):
        raise Unavailable("cannot reach the omni master at 127.0.0.1:1: connection refused")

    kv_get = kv_list = kv_delete = kv_put


async def test_master_unreachable_is_503_for_jobs_and_voices(tokenizer, tmp_path):
    _, jobs, c = frontend(tokenizer, DownKv(), tmp_path, voices=MasterVoiceStore(DownKv()))
    for r in (await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": SPEECH}),
              await c.get("/v1/omni/jobs"), await c.get("/v1/omni/jobs/job-" + "0" * 32),
              await c.get("/v1/audio/voices"),
              await c.post("/v1/audio/voices", json={"name": "x", "base": "joe"})):
        err = assert_error(r, 503, contains="cannot reach the omni master")
        assert err["type"] == "service_unavailable"
    assert jobs._tasks == {}


async def test_jobs_without_speech_stage_refuse_speech(tokenizer, tmp_path):
    orch = FakeOrchestrator(tokenizer)
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/audio/speech", "body": SPEECH})
        assert_error(r, 400, param="endpoint", contains="/v1/chat/completions")
        r = await c.post("/v1/omni/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": "tiny", "prompt": "hello"}})
        assert r.status_code == 200
        await settle(app.state.jobs)
        assert json.loads((await c.get(f"/v1/omni/jobs/{r.json()['id']}/content")).content)["choices"]


@pytest.mark.parametrize("persist", [False, True])
def test_launcher_gives_every_frontend_one_jobs_dir(tmp_path, persist):
    from omni import config as cfg
    from omni.launcher import Launcher, LaunchPlan

    plan = LaunchPlan(cfg.load("HuggingFaceTB/SmolLM2-135M-Instruct"), stages=[], api_server_count=2, port=0,
                      state_dir=str(tmp_path) if persist else None)
    launcher = Launcher(plan)
    launcher._plan_children()
    dirs = {c.argv[c.argv.index("--jobs-dir") + 1] for c in launcher.children if c.kind == "frontend"}
    assert len(dirs) == 1 and len(launcher.children) == 2
    jobs_dir = dirs.pop()
    assert os.path.isdir(jobs_dir)
    assert (jobs_dir == str(tmp_path / "jobs")) == persist
    launcher.shutdown()
    assert os.path.isdir(jobs_dir) == persist   # a temp one goes with the launcher


async def test_queued_jobs_deleted_through_another_frontend_free_their_places(tokenizer, tmp_path):
    """The owner's watcher looks up its running jobs only: 64 queued jobs deleted through frontend 1 kept their
    places on frontend 0, which refused new jobs with a 429 until its running ones ended."""
    from omni.api.jobs import MAX_QUEUED, MAX_RUNNING

    kv = LocalKv()
    orch0, jobs0, c0 = frontend(tokenizer, kv, tmp_path, 0, "h0")
    _, _, c1 = frontend(tokenizer, kv, tmp_path, 1, "h1")
    orch0.hang_after = 0       # the running ones never end
    job = {"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}}
    ids = [(await c0.post("/v1/omni/jobs", json=job)).json()["id"] for _ in range(MAX_RUNNING + MAX_QUEUED)]
    await asyncio.wait_for(orch0.started_event.wait(), 5)
    for job_id in ids[MAX_RUNNING:]:
        assert (await c1.delete(f"/v1/omni/jobs/{job_id}")).status_code == 200
    r = await c0.post("/v1/omni/jobs", json=job)
    assert r.status_code == 200, r.text
    assert len(jobs0._mine) == MAX_RUNNING + 1
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(orch0.requests) == MAX_RUNNING     # the deleted ones never ran
    await jobs0.close()
