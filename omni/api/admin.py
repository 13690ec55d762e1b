"""Admin routes: /v1/models, /health (and /ping), /version, /metrics, /openapi.json."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api.metrics_merge import merge
from omni.api.openapi import Facts
from omni.api.routes import openapi_spec
from omni.api.state import FrontendState

log = logging.getLogger(__name__)


class AdminRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe

    async def models(self, request: Request) -> Response:
        data = [{"id": n, "object": "model", "created": self.fe.created, "owned_by": "omni", "root": self.fe.model,
                 "parent": None, "max_model_len": self.fe.max_model_len}
                for n in [self.fe.model, *sorted(self.fe.names - {self.fe.model})]]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            ok, reason = self.fe.orch.health()
        except Exception as e:
            ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    def own_metrics(self) -> str:
        text = self.fe.metrics.render()
        try:
            text += self.fe.orch.metrics_text()
        except Exception as e:
            log.warning("orchestrator metrics failed: %s: %s", type(e).__name__, e)
            text += f"# orchestrator metrics unavailable: {type(e).__name__}\n"
        return text

    async def metrics(self, request: Request) -> Response:
        """The whole deployment: this frontend's metrics and the other live frontends' last published."""
        texts = [self.own_metrics()]
        if self.fe.peer_metrics is not None:
            try:
                texts += await self.fe.peer_metrics()
            except Exception as e:   # the master is away: this frontend's own view still answers
                log.info("peer metrics unavailable: %s: %s", type(e).__name__, e)
        return Response(merge(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(self, request: Request) -> Response:
        import omni

        return JSONResponse({"version": omni.version()})

    async def openapi(self, request: Request) -> Response:
        fe = self.fe
        if fe.speakers:
            builtin = fe.speakers
        elif fe.voices is not None:
            builtin = tuple(v["name"] for v in await fe.voices.list() if v.get("builtin"))
        else:
            builtin = ()
        facts = Facts(models=tuple(fe.names), vocab_size=fe.vocab_size,
                      max_tokens=fe.max_tokens_limit or max(1, fe.max_model_len - 1),
                      max_speech_chars=fe.max_speech_chars, audio_in=fe.audio_token_id is not None,
                      audio_out=fe.audio_out, builtin_voices=builtin, job_endpoints=fe.job_endpoints)
        return JSONResponse(openapi_spec(fe.model, facts))

