"""Async jobs (/v1/omni/jobs): run a normal request in the background, fetch its result later.

Job records live in the master's KV store (namespace `jobs`), so every frontend lists and
retrieves the same jobs; result bytes are files in a directory every frontend on the head host
reads. The frontend that accepted a job runs it by calling its own route handler in-process, so
a job's content is byte for byte what the synchronous call answers. Records name the running
frontend's pid: a job whose frontend is no longer registered reads as failed, not running forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import listing
from omni.api import protocol as P
from omni.api.errors import APIError, bad_request, to_api_error
from omni.api.job_prepared import PREPARED, Kept
from omni.api.job_store import JOB_ID_RE, LocalKv, Results, encode_record  # noqa: F401 (LocalKv: re-exported)
from omni.errors import Unavailable
from omni.orchestrator import quiesce

log = logging.getLogger(__name__)

NAMESPACE = "jobs"
BODY_TYPES = {"/v1/audio/speech": P.SpeechRequest, "/v1/chat/completions": P.ChatCompletionRequest,
              "/v1/completions": P.CompletionRequest, "/v1/images/generations": P.ImageGenerationRequest}
PENDING = ("queued", "in_progress")
HIDDEN = ("owner", "created_ns")
# A job record must fit the master's KV value cap (64 KiB): an error message is cut to this
# (a 1.5 MB unknown model name echoed back left a job unable to store its end, "in progress").
MAX_ERROR_CHARS = 4096
# What a job whose end the master refused (_finish) reads as.
REFUSED_END = ("the job ended, but the master refused its final record (the jobs namespace is at its byte or "
               "entry limit, or the record over the value limit); its result is not kept: submit it again")
WATCH_S = 0.5      # how often a frontend running jobs looks for ones deleted through another frontend
FINISH_S = 30.0    # how long the final status write is retried while the master is unreachable
# Jobs one frontend runs at once; the others wait "queued". Unbounded, a burst of jobs filled the
# stages' queues and a synchronous request behind them waited over a minute (Schemathesis run).
MAX_RUNNING = 2
# Jobs one frontend holds waiting besides those: each keeps its request body (up to the body cap) until it
# runs, so an unbounded queue let a client pin gigabytes. More get a 429 naming the limit.
MAX_QUEUED = 64
# How often a frontend removes results whose record is gone: the master expires job records
# (omni/master/kv.py), and nothing else deletes their files.
SWEEP_S = 3600.0
ID_PREFIXES = ("job-", "video_")   # video_: the Videos API's (omni/api/videos.py)
# Jobs whose check result (a chat's templated prompt and decoded audio) is kept for their run (job_prepared);
# later ones prepare again when they run.
MAX_PREPARED = MAX_RUNNING

Handler = Callable[[Request], Awaitable[Response]]
# body -> the route's work up to running it (its result, when not None, is the route handler's `prepared` at
# the run), raising the APIError the route would answer before running anything: the body's type, fields refused
# by name, ranges, the model, the voice
Check = Callable[[bytes], Awaitable[object]]
# -> (HTTP status, content type, body) of a job's work: a route's answer, or the Videos API's MP4
Work = Callable[[], Awaitable["tuple[int, str, bytes]"]]
# -> {(host, pid)} of the registered frontends, or None while that is unknown (no topology yet)
LiveFrontends = Callable[[], "set[tuple[str, int]] | None"]


class JobRequest(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str
    body: dict[str, Any]


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in HIDDEN}


def _not_found(job_id: str, what: str = "job") -> APIError:
    return APIError(404, f"{what} `{job_id}` does not exist", type="not_found_error", param=f"{what}_id",
                    code=f"{what}_not_found")


def _cut(text, limit: int):
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _error(message: str, type: str = "server_error", param: str | None = None, code: str | None = None) -> dict:
    return {"message": _cut(message, MAX_ERROR_CHARS), "type": _cut(type, 64), "param": _cut(param, 256),
            "code": _cut(code, 64)}


class Jobs:
    """The job routes of one frontend. `kv` is the master client (or LocalKv); `bind` gives the handlers."""

    def __init__(self, kv: Any = None, results: Results | None = None, *, frontend_index: int = 0,
                 host: str = "", live_frontends: LiveFrontends | None = None):
        self.kv = kv if kv is not None else LocalKv()
        self.results = results if results is not None else Results()
        self.frontend_index = frontend_index
        self.owner = {"host": host, "pid": os.getpid(), "frontend": frontend_index}
        self.live_frontends = live_frontends
        self.handlers: dict[str, Handler] = {}
        self.checks: dict[str, Check] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._mine: set[str] = set()   # accepted here and not finished: ours even before the task exists
        self.admit: Callable[[], None] = lambda: None   # the frontend's gate (a sleep with mode=wait: 503)
        self._running: set[str] = set()   # holding a slot: the jobs the watcher looks up
        self._waiting: set[str] = set()   # stored and waiting for a slot
        self._watcher: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._slots = asyncio.Semaphore(MAX_RUNNING)
        self._kept = Kept(MAX_PREPARED)
        self._on_end: dict[str, Callable[[], None]] = {}
        # When records() last read the whole namespace, and whether it held ids made before they sorted
        # by time (a master's state from an older omni): while it may, a list reads every record.
        self._legacy_seen: tuple[float, bool] | None = None

    def bind(self, handlers: dict[str, Handler], checks: dict[str, Check] | None = None) -> None:
        """The endpoints jobs may run (only those this pipeline serves), path -> route handler; `checks`:
        path -> the route's own preparation of a body, run at create time, so a job is refused as the route
        would refuse the body (an endpoint without one gets its body's type checked only)."""
        self.handlers = {p: h for p, h in handlers.items() if p in BODY_TYPES}
        self.checks = {p: c for p, c in (checks or {}).items() if p in self.handlers}

    # ---- routes

    async def create(self, request: Request) -> Response:
        spec = P.decode_body(await request.body(), JobRequest)
        if spec.endpoint not in self.handlers:
            raise bad_request(f"endpoint `{spec.endpoint}` cannot run as a job here; one of: "
                              f"{', '.join(self.handlers) or 'none'}", param="endpoint")
        for name in ("stream", "stream_format"):     # a stream's bytes (SSE, a WAV of unknown length) are no result
            if spec.body.get(name):
                raise bad_request(f"a job cannot stream; drop body.{name} or call the endpoint directly",
                                  param=f"body.{name}")
        if spec.endpoint == "/v1/audio/speech" and spec.body.get("response_format") == "pcm":
            raise bad_request("a job's result keeps no X-Sample-Rate, and raw pcm says no rate itself: ask for wav "
                              "(its header carries the rate) or call the endpoint directly", param="body.response_format")
        body = msgspec.json.encode(spec.body)
        ready = None
        try:  # wrong types, missing fields and a route's own bounds are refused now, not as a failed job later
            check = self.checks.get(spec.endpoint)
            if check is not None:
                ready = await check(body)     # the route's own parse: the body's type, then its bounds
            else:
                P.decode_body(body, BODY_TYPES[spec.endpoint])
        except APIError as e:
            raise APIError(e.status, f"body: {e.message}", type=e.type, param=f"body.{e.param}" if e.param else "body",
                           code=e.code) from None
        endpoint = spec.endpoint    # the closure keeps the encoded body, and the check's result while kept
        take, drop = self._kept.keep(ready)
        try:
            return JSONResponse(await self.submit(endpoint, lambda: self._call(endpoint, body, take()), on_end=drop))
        except BaseException:
            drop()
            raise

    async def submit(self, endpoint: str, work: Work, *, prefix: str = "job-", extra: dict | None = None,
                     on_end: Callable[[], None] | None = None) -> dict:
        """Store a queued job and start `work` in the background; its public record. `extra`: fields the
        record keeps for its reader (the Videos API's parameters); `on_end`: called when the job's task ends,
        whether or not `work` ran."""
        self.admit()
        if len(self._mine) >= MAX_RUNNING + MAX_QUEUED:
            await self._drop_deleted_waiting()
        if len(self._mine) >= MAX_RUNNING + MAX_QUEUED:
            raise APIError(429, f"this frontend holds {len(self._mine)} unfinished jobs, its limit ({MAX_RUNNING} "
                           f"running, {MAX_QUEUED} queued); retry once some finish or delete some",
                           type="rate_limit_error", code="too_many_jobs")
        now = time.time_ns()
        record = {"id": listing.job_id(prefix, now), "object": "omni.job", "endpoint": endpoint,
                  "status": "queued", "created_at": now // 10**9, "completed_at": None,
                  "frontend": self.frontend_index, "error": None, "content_type": None, "bytes": None,
                  "owner": self.owner, "created_ns": now, **(extra or {})}
        self._mine.add(record["id"])
        try:
            await self._save(record)   # master unreachable: 503 and nothing runs
        except BaseException:
            self._mine.discard(record["id"])
            raise
        if on_end is not None:
            self._on_end[record["id"]] = on_end
        task = self._tasks[record["id"]] = asyncio.create_task(self._run(record, work), name=record["id"])
        task.add_done_callback(lambda _, job_id=record["id"]: self._ended(job_id))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_deletions())
        return _public(record)

    async def list(self, request: Request) -> Response:
        return JSONResponse(await self.page(request, "job"))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self.record(request.path_params["job_id"]))

    async def content(self, request: Request) -> Response:
        return await self.download(request.path_params["job_id"])

    async def delete(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        await self.remove(job_id)
        return JSONResponse({"id": job_id, "object": "omni.job.deleted", "deleted": True})

    # ---- what the routes above (and the Videos API) read and change

    async def records(self, endpoint: str | None = None) -> list[dict]:
        """Every job's public record (of one endpoint), newest first."""
        entries = await self.kv.kv_list(NAMESPACE)
        self._legacy_seen = (time.monotonic(), any(map(listing.is_legacy, entries)))
        records = [json.loads(v) for v in entries.values()]
        records = [r for r in records if endpoint is None or r.get("endpoint") == endpoint]
        records.sort(key=lambda r: r.get("created_ns", 0), reverse=True)
        live = self._live()
        return [self._view(r, live) for r in records]

    async def page(self, request: Request, what: str, prefixes: tuple[str, ...] = ID_PREFIXES,
                   endpoint: str | None = None, view: Callable[[dict], dict] = lambda job: job) -> dict:
        """One page of the list (`view` of each public record, newest first) as OpenAI's list object:
        the `limit` + 1 records after the cursor under each of `prefixes` (their keys sort by time),
        merged. order=asc, or a namespace that may hold ids from before, reads every record."""
        limit, order, after = listing.list_params(request, what)
        seen = self._legacy_seen
        if order == "asc" or seen is None or seen[1] or time.monotonic() - seen[0] > SWEEP_S:
            items = [view(r) for r in await self.records(endpoint)]
            return listing.list_page(request, items, what)
        if after is not None and (not after.startswith(prefixes) or not JOB_ID_RE.fullmatch(after)
                                  or await self.kv.kv_get(NAMESPACE, after) is None):
            raise listing.no_such_cursor(after, what)
        entries: dict[str, bytes] = {}
        for prefix in prefixes:
            start = prefix + listing.order_key(after) if after else ""
            entries.update(await self.kv.kv_list(NAMESPACE, prefix, max_entries=limit + 1, start_after=start))
        keys = sorted(entries, key=listing.order_key)[:limit + 1]
        live = self._live()
        return listing.page([view(self._view(json.loads(entries[k]), live)) for k in keys], limit, what)

    async def record(self, job_id: str, what: str = "job") -> dict:
        return self._view(await self._get(job_id, what), self._live())

    async def download(self, job_id: str, what: str = "job", media_type: str | None = None) -> Response:
        """A completed job's result as the answer (its file streamed from the result folder, `media_type` or the
        job's content type); 409 while it is not completed, 404 once gone."""
        job = await self.record(job_id, what)
        if job["status"] != "completed":
            why = f": {job['error']['message']}" if job["error"] else ""
            raise APIError(409, f"{what} `{job['id']}` is {job['status']}, not completed{why}",
                           param=f"{what}_id", code=f"{what}_not_completed")
        response = await self.results.response(job["id"], media_type or job["content_type"])
        if response is None:
            raise APIError(404, f"the result of {what} `{job['id']}` is gone from the result store",
                           type="not_found_error", param=f"{what}_id")
        return response

    async def remove(self, job_id: str, what: str = "job") -> None:
        """Delete a job, its result and (running here) its work; one running elsewhere is cancelled by
        its frontend's watcher."""
        await self._get(job_id, what)
        await self.kv.kv_delete(NAMESPACE, job_id)
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
        await self.results.delete(job_id)

    async def start(self) -> None:
        """Sweep results left without a record now, and every SWEEP_S while the frontend runs."""
        await self._sweep_once()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def sweep(self) -> list[str]:
        """Delete the results whose job has no record (expired, or deleted while this frontend was down), and
        temp files of result writes that never ended (a frontend killed mid-write), over an hour old."""
        temps = await self.results.remove_stale_temps(keep=set(self._mine))
        if temps:
            log.info("removed %d temp files of result writes that never ended", len(temps))
        held = await self.results.ids()   # first: a result made after this has its record in the list below
        if not held:
            return []
        present = await self.kv.kv_list(NAMESPACE)
        gone = [i for i in held if i not in present and i not in self._mine]
        for job_id in gone:
            await self.results.delete(job_id)
        if gone:
            log.info("removed %d job results whose records are gone", len(gone))
        return gone

    async def _sweep_once(self) -> None:
        try:
            await self.sweep()
        except Exception as e:    # the master away: the next sweep
            log.info("job result sweep: %s", e)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)   # pacing, not synchronisation
            await self._sweep_once()

    async def close(self) -> None:
        """Cancel running jobs (a stopping frontend deregisters, so readers see them failed)."""
        tasks = list(self._tasks.values())
        tasks += [t for t in (self._watcher, self._sweeper) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- state

    async def _get(self, job_id: str, what: str = "job") -> dict:
        if not JOB_ID_RE.fullmatch(job_id):   # match: `$` takes "job-...\n" too
            raise _not_found(job_id, what)
        blob = await self.kv.kv_get(NAMESPACE, job_id)
        if blob is None:
            raise _not_found(job_id, what)
        return json.loads(blob)

    async def _save(self, record: dict, only_if_exists: bool = False) -> bool:
        """Store the record; whether it did (`only_if_exists`: not when the job was deleted)."""
        return await self.kv.kv_put(NAMESPACE, record["id"], encode_record(record), only_if_exists=only_if_exists)

    def _live(self) -> set[tuple[str, int]] | None:
        return self.live_frontends() if self.live_frontends is not None else None

    def _view(self, record: dict, live: set[tuple[str, int]] | None) -> dict:
        """The public job; a pending one whose frontend is gone reads as failed."""
        owner = record.get("owner") or {}
        if record["status"] in PENDING:
            if owner.get("pid") == self.owner["pid"] and owner.get("host") == self.owner["host"]:
                gone = record["id"] not in self._mine
            else:
                gone = live is not None and (owner.get("host"), owner.get("pid")) not in live
            if gone:
                msg = (f"frontend {owner.get('frontend')} (pid {owner.get('pid')}) that ran this job is gone; "
                       f"submit it again")
                record = {**record, "status": "failed", "error": _error(msg, code="frontend_gone")}
        elif record["status"] == "failed" and record.get("error") is None:   # _finish's fallback
            record = {**record, "error": _error(REFUSED_END, code="record_refused")}
        return _public(record)

    # ---- running

    async def _run(self, record: dict, work: Work) -> None:
        job_id = record["id"]
        self._waiting.add(job_id)
        try:
            async with self._slots:
                self._waiting.discard(job_id)
                self._running.add(job_id)
                try:
                    # Only over the record: a job deleted (through any frontend) before it started, even
                    # between a read and this write, stays deleted and never runs.
                    if not await self._save({**record, "status": "in_progress"}, only_if_exists=True):
                        return
                    quiesce.ACCEPTED.set(True)   # accepted before any hold: a sleep with mode=wait waits for it
                    final = await self._execute(record["endpoint"], job_id, work)
                finally:
                    self._running.discard(job_id)
        except asyncio.CancelledError:
            await self.results.delete(job_id)
            raise
        except Exception as e:
            err = to_api_error(e)
            final = {"status": "failed", "error": _error(err.message, err.type, err.param, err.code)}
        await self._finish(record, {**final, "completed_at": int(time.time())})

    @property
    def unfinished(self) -> int:
        """Jobs accepted here and not finished, queued ones too: in flight for a sleep with mode=wait."""
        return len(self._mine)

    def _ended(self, job_id: str) -> None:
        # A done callback, not a `finally`: a task cancelled before its first step never runs its body,
        # and would hold one of MAX_QUEUED places for good.
        self._tasks.pop(job_id, None)
        self._mine.discard(job_id)
        self._waiting.discard(job_id)
        on_end = self._on_end.pop(job_id, None)
        if on_end is not None:
            on_end()

    async def _execute(self, endpoint: str, job_id: str, work: Work) -> dict:
        status, ctype, content = await work()
        if status == 200:
            await self.results.put(job_id, content)
            return {"status": "completed", "content_type": ctype, "bytes": len(content)}
        try:
            e = json.loads(content)["error"]
            error = _error(e["message"], e.get("type") or "server_error", e.get("param"), e.get("code"))
        except (ValueError, KeyError, TypeError):
            error = _error(f"{endpoint} answered HTTP {status}: {content[:200]!r}")
        return {"status": "failed", "error": error}

    async def _call(self, endpoint: str, body: bytes, ready: Any = None) -> tuple[int, str, bytes]:
        """POST body to our own handler over ASGI, in this process; (status, content type, body). `ready`: the
        body's check result, which the handler takes (prepared) in place of preparing the body again."""
        scope = {PREPARED: ready, "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": endpoint, "raw_path": endpoint.encode(), "root_path": "",
                 "query_string": b"", "client": None, "server": None,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        delivered = False
        never = asyncio.Event()

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()   # no client to disconnect; cancelling the job ends this wait

        out: dict = {"status": 500, "ctype": "", "body": bytearray()}

        async def send(message):
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
                out["ctype"] = next((v.decode() for k, v in message.get("headers", [])
                                     if k.lower() == b"content-type"), "application/octet-stream")
            elif message["type"] == "http.response.body":
                out["body"] += message.get("body", b"")

        response = await self.handlers[endpoint](Request(scope, receive))
        await response(scope, receive, send)
        return out["status"], out["ctype"], bytes(out["body"])

    async def _finish(self, stored: dict, final: dict) -> None:
        """Store the job's end over `stored`, its queued record. A refused end (the namespace at its cap: the end is
        larger) becomes `stored` marked failed, which is no larger than what the key holds (queued, or
        in_progress), so the master, which takes any write that does not grow a namespace, takes it."""
        record = {**stored, **final}
        deadline = time.monotonic() + FINISH_S
        while True:
            try:
                # Only over the record: a job deleted (through any frontend) while it ran, even between
                # a read and this write, stays deleted, and its result goes.
                if not await self._save(record, only_if_exists=True):
                    await self.results.delete(record["id"])
                return
            except Unavailable as e:
                if time.monotonic() > deadline:
                    log.warning("job %s finished as %s but its status could not be stored: %s",
                                record["id"], record["status"], e)
                    return
                await asyncio.sleep(1.0)   # retry pacing while the master is away, not synchronisation
            except Exception as e:
                if record["status"] == "failed" and record.get("error") is None:
                    log.warning("job %s: not even its failure could be stored: %s", record["id"], e)
                    return
                log.warning("job %s finished as %s but the master refused its record (%s); stored as failed",
                            record["id"], record["status"], e)
                await self.results.delete(record["id"])
                record = {**stored, "status": "failed"}   # error None: readers say why (_view)

    async def _drop_deleted_waiting(self) -> None:
        """Forget this frontend's waiting jobs deleted through another frontend (the watcher looks up running
        ones only), so they stop holding queue places: before a 429, one kv_get each (at most MAX_QUEUED)."""
        waiting = list(self._waiting)
        try:
            blobs = await asyncio.gather(*(self.kv.kv_get(NAMESPACE, j) for j in waiting))
        except Exception as e:    # the master away: the 429 stands
            log.debug("job queue check: %s", e)
            return
        for job_id, blob in zip(waiting, blobs):
            task = self._tasks.get(job_id)
            if blob is None and task is not None and job_id in self._waiting:
                task.cancel()
                self._mine.discard(job_id)   # now, not at the task's end: this submit counts without it

    async def _watch_deletions(self) -> None:
        """Cancel this frontend's running jobs that were deleted through another frontend: one kv_get per
        running job (at most MAX_RUNNING) every WATCH_S, not the whole namespace; a queued job looks its
        record up itself when it gets a slot."""
        while self._tasks:
            await asyncio.sleep(WATCH_S)
            for job_id in list(self._running):
                try:
                    gone = await self.kv.kv_get(NAMESPACE, job_id) is None
                except Exception as e:
                    log.debug("job watcher: %s", e)
                    break
                task = self._tasks.get(job_id)
                if gone and task is not None and job_id in self._running:
                    task.cancel()
