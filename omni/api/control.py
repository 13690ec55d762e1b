"""Control routes: /v1/omni/sleep, /v1/omni/wakeup (guarded: see http.FrontendMiddleware) and
/v1/omni/is_sleeping."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api import protocol as P
from omni.api.errors import bad_request
from omni.api.state import FrontendState


class ControlRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def sleep(self, request: Request) -> Response:
        body = await request.body()
        req = P.decode_body(body, P.SleepRequest) if body.strip() else P.SleepRequest()
        if req.level not in (1, 2):
            raise bad_request(f"level={req.level} must be 1 or 2", param="level")
        return JSONResponse(await self.fe.orch.sleep(req.level))

    async def wake_up(self, request: Request) -> Response:
        return JSONResponse(await self.fe.orch.wake_up())

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(await self.fe.orch.is_sleeping())})
