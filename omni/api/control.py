"""Control routes: /v1/omni/sleep, /v1/omni/wakeup (guarded: see http.FrontendMiddleware) and
/v1/omni/is_sleeping.

Sleep and wakeup answer each replica's ack in `results`: 200 when at least one replica acked ok (a partial
outcome: the others' messages say why), 409 when every replica refused, 503 when none was there to ask.
Sleep's `mode` is vLLM's: abort (the default) ends the requests in flight with a 503 that says why; wait
lets them finish first (omni/orchestrator/quiesce.py). Both take vllm-omni's `stage_ids` (none: every stage).
Sleep's level is 2 on /v1/omni/sleep (vllm-omni's default) and 1 on vLLM's /sleep.
Beside omni's fields every answer has vllm-omni's `status` and `acks` (_answer)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import protocol as P
from omni.api.errors import bad_request, error_body
from omni.api.state import FrontendState
from omni.digits import ascii_int


class ControlRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def sleep(self, request: Request) -> Response:
        body = await request.body()
        raw = P.decode_body(body, dict) if body.strip() else {}
        if isinstance(raw, dict) and raw.get("mode") == "keep":
            raise _keep_refused()
        req = P.decode_body(body, P.SleepRequest) if body.strip() else P.SleepRequest()
        level, mode, stage_ids = req.level, req.mode, _stage_ids(request, req.stage_ids)
        # vLLM's POST /sleep takes level and mode from the query string: taken here too.
        for name, value in request.query_params.multi_items():
            if name == "mode":
                if value == "keep":
                    raise _keep_refused()
                if value not in ("abort", "wait"):
                    raise bad_request(f"mode={value!r} must be abort or wait", param="mode")
                if "mode" in raw and value != req.mode:
                    raise bad_request(f"mode is {value} in the query string and {req.mode} in the body", param="mode")
                mode = value
            elif name == "level":
                level = ascii_int(value)                          # int() reads '١' as 1
                if level is None:
                    raise bad_request(f"level={value[:20]!r} must be 1 or 2", param="level")
                if req.level is not None and level != req.level:
                    raise bad_request(f"level is {level} in the query string and {req.level} in the body",
                                      param="level")
            elif name != "stage_ids":
                raise bad_request(f"query parameter `{name}` is not supported: sleep takes `level`, `mode` and "
                                  "`stage_ids`", param=name)
        if level is None:
            level = 1 if request.url.path == "/sleep" else 2
        if level not in (1, 2):
            why = (" (vLLM's level 0 pauses scheduling alone and queues requests; omni has no such pause)"
                   if level == 0 else "")
            raise bad_request(f"level={str(level)[:20]} must be 1 or 2{why}", param="level")
        return _outcome("sleep", await self.fe.orch.sleep(level, mode, stage_ids))

    async def wake_up(self, request: Request) -> Response:
        # vLLM's /wake_up takes `tags` (weights, kv_cache, scheduling) to wake part of the engine; omni's
        # engines wake whole, so a tag is refused rather than answered as if that part alone woke.
        body = await request.body()
        raw = P.decode_body(body, dict) if body.strip() else {}
        for name in [n for n, _ in request.query_params.multi_items()] + list(raw if isinstance(raw, dict) else ()):
            if name == "tags":
                raise bad_request("`tags` is not supported: omni wakes every stage whole (weights, KV cache and "
                                  "scheduling at once); call it without tags", param="tags")
            if name != "stage_ids":
                raise bad_request(f"`{name}` is not supported: wakeup takes only `stage_ids`", param=name)
        req = P.decode_body(body, P.WakeupRequest) if body.strip() else P.WakeupRequest()
        return _outcome("wakeup", await self.fe.orch.wake_up(_stage_ids(request, req.stage_ids)))

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(await self.fe.orch.is_sleeping())})


def _stage_ids(request: Request, body_ids: list[int] | None) -> tuple[int, ...]:
    """vllm-omni's `stage_ids`, from the body or the query string (repeated); () is every stage."""
    values = request.query_params.getlist("stage_ids")
    if not values:
        return tuple(body_ids or ())
    if body_ids is not None:
        raise bad_request("stage_ids is in both the query string and the body: give it once", param="stage_ids")
    ids = [ascii_int(v) for v in values[:P.MAX_STAGE_IDS + 1]]
    if any(i is None for i in ids) or len(ids) > P.MAX_STAGE_IDS:
        raise bad_request(f"stage_ids takes up to {P.MAX_STAGE_IDS} stage ids, each a non-negative integer "
                          "(repeat it: ?stage_ids=0&stage_ids=1)", param="stage_ids")
    return tuple(ids)


def _keep_refused():
    return bad_request("mode=keep is not supported: omni's stages drop their KV caches asleep, so a request "
                       "cannot be kept across a sleep; use mode=abort (the default) or mode=wait", param="mode")


def _outcome(verb: str, out: dict) -> Response:
    """200 unless no replica acked ok: then an OpenAI error body beside the same `results`, so a client
    that reads only the status does not take a refused sleep for a done one."""
    busy = [f for f in out.get("frontends", ()) if not f["ok"]]
    if busy:   # mode=wait: a frontend still had requests in flight at the end of the wait, or was not reached
        why = "; ".join(f"{f['replica_id']}: {f['message']}" for f in busy)
        if any(f.get("outcome") == "disconnected" for f in busy):   # SUSPECT: its requests are not known
            return _answer(out, 503, error_body(f"{verb} (mode=wait): nothing was put to sleep: a frontend cannot "
                                                f"be reached: {why}", "service_unavailable",
                                                code="frontend_unreachable"))
        return _answer(out, 409, error_body(f"{verb} (mode=wait): nothing was put to sleep: {why}", "conflict_error",
                                            code="sleep_busy"))
    results = out.get("results")
    if results is None or any(r["ok"] for r in results):
        return _answer(out, 200)
    if not results:
        return _answer(out, 503, error_body(f"{verb}: no live stage replica to send it to", "service_unavailable"))
    refused = "; ".join(f"stage {r['stage_id']} ({r['replica_id']}): {r['message']}" for r in results)
    return _answer(out, 409, error_body(f"{verb} refused by every stage replica: {refused}", "conflict_error",
                                        code=f"{verb}_refused"))


def _answer(out: dict, status_code: int, error: dict | None = None) -> JSONResponse:
    """omni's fields, and beside them vllm-omni's: `status` (SUCCESS for a 200, else ERROR) and `acks`, one
    per replica as its OmniACK reads (status SUCCESS or ERROR, stage_id, error_msg; replica_id is omni's).
    OmniACK's freed_bytes, rank and task_id are left out: omni's acks do not carry them, and a made-up 0
    would read as nothing freed."""
    acks = [{"status": "SUCCESS" if r["ok"] else "ERROR", "stage_id": r["stage_id"], "replica_id": r["replica_id"],
             "error_msg": None if r["ok"] else r["message"]} for r in out.get("results") or ()]
    vllm_omni = {"status": "SUCCESS" if status_code == 200 else "ERROR", "acks": acks}
    return JSONResponse({**(error or {}), **out, **vllm_omni}, status_code=status_code)
