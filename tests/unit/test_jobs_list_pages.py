"""GET /v1/omni/jobs and /v1/videos read one page of records from the master's KV, not the whole jobs
namespace (up to 10,000 records, 64 MiB, per call: 0.25-0.7 s against a real master), and answer what
reading every record answers: newest first, `limit`, `after`, `order`, has_more."""

from __future__ import annotations

import json
import uuid

import pytest
from starlette.requests import Request

from omni.api.job_store import encode_record
from omni.api.jobs import NAMESPACE, Jobs, LocalKv
from omni.api.listing import list_page
from omni.api.videos import video_object

pytestmark = pytest.mark.anyio

NS_MAX = (1 << 64) - 1
T0 = 1_700_000_000 * 10**9


class CountingKv(LocalKv):
    def __init__(self):
        super().__init__()
        self.read = 0      # entries moved by kv_list

    async def kv_list(self, namespace, prefix="", **kw):
        out = await super().kv_list(namespace, prefix, **kw)
        self.read += len(out)
        return out


def time_ordered(prefix: str, ns: int) -> str:
    return f"{prefix}{NS_MAX - ns:016x}0{uuid.uuid4().hex[:15]}"


async def store(kv, job_id: str, ns: int, endpoint: str = "/v1/audio/speech") -> None:
    record = {"id": job_id, "object": "omni.job", "endpoint": endpoint, "status": "completed",
              "created_at": ns // 10**9, "completed_at": ns // 10**9, "frontend": 0, "error": None,
              "content_type": "audio/wav", "bytes": 4, "owner": {"host": "h", "pid": 1, "frontend": 0},
              "created_ns": ns}
    if endpoint == "/v1/videos":
        record["video"] = {"model": "m", "prompt": f"p{ns}", "size": "64x64"}
    await kv.kv_put(NAMESPACE, job_id, encode_record(record))


def request(query: str) -> Request:
    return Request({"type": "http", "query_string": query.encode(), "headers": []})


async def listed(jobs: Jobs, query: str) -> dict:
    return json.loads((await jobs.list(request(query))).body)


async def filled(n: int, legacy: int = 0) -> tuple[CountingKv, Jobs]:
    kv = CountingKv()
    for i in range(n):
        prefix, endpoint = ("video_", "/v1/videos") if i % 3 == 0 else ("job-", "/v1/audio/speech")
        await store(kv, time_ordered(prefix, T0 + i * 1000), T0 + i * 1000, endpoint)
    for i in range(legacy):   # ids from before: uuid4's hex, in no time order
        await store(kv, f"job-{uuid.uuid4().hex}", T0 + i * 1000 + 500)
    return kv, Jobs(kv)


async def everything(jobs: Jobs, query: str, endpoint=None, view=lambda r: r, what="job") -> dict:
    """What reading every record answers (the list before pages)."""
    return list_page(request(query), [view(r) for r in await jobs.records(endpoint)], what)


async def test_a_jobs_list_reads_one_page_not_the_namespace():
    kv, jobs = await filled(300)
    first = await listed(jobs, "limit=20")      # the first list also looks for ids from before
    kv.read = 0
    second = await listed(jobs, f"limit=20&after={first['last_id']}")
    assert kv.read <= 2 * 21, kv.read           # before: all 300 records, each call
    assert second == await everything(jobs, f"limit=20&after={first['last_id']}")


@pytest.mark.parametrize("query", ["", "limit=1", "limit=100", "limit=7&order=asc", "limit=5&after={cursor}",
                                   "limit=5&order=asc&after={cursor}", "limit=100&after={last}"])
async def test_a_page_is_what_reading_every_record_gives(query):
    kv, jobs = await filled(120)
    all_ids = [r["id"] for r in await jobs.records()]
    q = query.format(cursor=all_ids[37], last=all_ids[-3])
    assert await listed(jobs, q) == await everything(jobs, q)
    video = [r["id"] for r in await jobs.records("/v1/videos")]
    q = query.format(cursor=video[11], last=video[-3])
    got = await jobs.page(request(q), "video", ("video_",), "/v1/videos", video_object)
    assert got == await everything(jobs, q, "/v1/videos", video_object, "video")


async def test_a_cursor_that_names_no_listed_job_is_a_404():
    from omni.api.errors import APIError

    kv, jobs = await filled(30)
    await listed(jobs, "")
    job = next(r["id"] for r in await jobs.records() if r["id"].startswith("job-"))
    for q, what, prefixes in ((f"after=job-{'0' * 32}", "job", ("job-", "video_")),
                              (f"after={job}", "video", ("video_",))):   # a job is no video
        with pytest.raises(APIError) as e:
            await jobs.page(request(q), what, prefixes)
        assert e.value.status == 404 and e.value.param == "after"


async def test_ids_from_before_keep_the_whole_read_and_its_order():
    kv, jobs = await filled(40, legacy=15)
    await listed(jobs, "")
    for q in ("limit=10", "limit=100"):
        kv.read = 0
        assert await listed(jobs, q) == await everything(jobs, q)
        assert kv.read == 2 * 55                # this list's read, and everything()'s


async def test_new_ids_sort_newest_first_and_are_never_taken_for_old_ones():
    from omni.api.listing import is_legacy, job_id

    ids = [job_id("job-", T0 + i) for i in range(50)]
    assert sorted(ids) == ids[::-1]
    assert not any(map(is_legacy, ids)) and is_legacy(f"job-{uuid.uuid4().hex}")
