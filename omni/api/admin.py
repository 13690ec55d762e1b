"""Admin routes: /v1/models (and /v1/models/{model}), /health (and /ping), /version, /metrics, /openapi.json."""

from __future__ import annotations

import logging
import uuid
from typing import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni.api.errors import APIError
from omni.api.metrics_merge import merge
from omni.api.openapi import Facts
from omni.api.routes import openapi_spec
from omni.api.state import RENDER_PARAMS, FrontendState

log = logging.getLogger(__name__)


# vllm-omni's /health body ("healthy"; 503 "unhealthy"). vLLM's is an empty 200: a client of it reads only the status.
_HEALTHY = b'{"status":"healthy"}'


class AdminRoutes:
    def __init__(self, fe: FrontendState):
        self.fe = fe
        self._models_for: int | None = None     # the max_model_len self._models_body was encoded with
        self._models_body = b""
        self._permission_ids: dict[str, str] = {}   # served name -> its card's permission id, one per process

    def _models(self) -> bytes:
        """As vLLM's: a card per served name, in --served-model-name's order; then the other names
        answered to (aliases). Encoded again only when max_model_len changed (limits.follow_limits sets
        it from the prompt stage's replicas as they register)."""
        fe = self.fe
        if self._models_for != fe.max_model_len:
            data = [self._card(n) for n in [*fe.served_names, *sorted(fe.names - set(fe.served_names))]]
            self._models_body = msgspec.json.encode({"object": "list", "data": data})
            self._models_for = fe.max_model_len
        return self._models_body

    def _card(self, name: str) -> dict:
        """vLLM's ModelCard, its `permission` too: vLLM lists one ModelPermission with its defaults (sampling,
        logprobs and view allowed; no engine creation, fine-tuning or search indices) and a client may read it."""
        fe = self.fe
        perm_id = self._permission_ids.setdefault(name, f"modelperm-{uuid.uuid4().hex}")
        permission = {"id": perm_id, "object": "model_permission", "created": fe.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": fe.created, "owned_by": "omni", "root": fe.model_path,
                "parent": None, "max_model_len": fe.max_model_len, "permission": [permission]}

    def fast(self) -> dict[tuple[str, str], Callable[[], tuple[int, bytes]]]:
        """(method, path) -> (status, JSON body) for the bodiless probes that FrontendMiddleware
        answers without Starlette's routing (load balancers poll them: see http.FrontendMiddleware)."""
        import omni

        version = msgspec.json.encode({"version": omni.version()})
        return {("GET", "/health"): self._health, ("GET", "/ping"): self._health,
                ("POST", "/ping"): self._health, ("GET", "/v1/models"): lambda: (200, self._models()),
                ("GET", "/version"): lambda: (200, version)}

    def _health(self) -> tuple[int, bytes]:
        try:
            ok, reason = self.fe.orch.health()
        except Exception as e:
            ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
        if ok:   # a reason beside "healthy" (the master away) keeps the status a client reads
            return 200, _HEALTHY if reason == "ok" else msgspec.json.encode({"status": "healthy", "reason": reason})
        return 503, msgspec.json.encode({"status": "unhealthy", "reason": reason})

    async def models(self, request: Request) -> Response:
        return Response(self._models(), media_type="application/json")

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the card /v1/models lists for that name, or OpenAI's model_not_found 404."""
        name = request.path_params["model"]
        self.fe.check_model(name)
        if not name:   # "" is the default model in a request's body; here it names none
            raise APIError(404, "GET /v1/models/{model} needs a model name", param="model", code="model_not_found")
        return JSONResponse(self._card(name))

    async def health(self, request: Request) -> Response:
        status, body = self._health()
        return Response(body, status_code=status, media_type="application/json")

    def own_metrics(self) -> str:
        text = self.fe.metrics.render()
        try:
            text += self.fe.orch.metrics_text()
        except Exception as e:
            log.warning("orchestrator metrics failed: %s: %s", type(e).__name__, e)
            text += f"# orchestrator metrics unavailable: {type(e).__name__}\n"
        return text

    async def metrics(self, request: Request) -> Response:
        """The whole deployment: this frontend's metrics and the other live frontends' last published.
        Its own are published first and served as published, so each frontend's series come from one
        source, the KV copy, whichever frontend answers: a counter never goes back from one scrape
        to the next (another frontend's figures are up to PUBLISH_S old)."""
        own = None
        if self.fe.publish_metrics is not None:
            try:
                own = await self.fe.publish_metrics()
            except Exception as e:   # the master is away or refused it: the live text still answers
                log.info("metrics publish failed: %s: %s", type(e).__name__, e)
        texts = [own if own is not None else self.own_metrics()]
        if self.fe.peer_metrics is not None:
            try:
                texts += await self.fe.peer_metrics()
            except Exception as e:   # the master is away: this frontend's own view still answers
                log.info("peer metrics unavailable: %s: %s", type(e).__name__, e)
        # The stages' own figures: one copy, from this frontend's topology (an in-memory fake has none).
        deployment = getattr(self.fe.orch, "deployment_metrics_text", None)
        if deployment is not None:
            texts.append(deployment())
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
                      audio_out=fe.audio_out, builtin_voices=builtin, job_endpoints=fe.job_endpoints,
                      images=fe.images, videos=fe.videos, num_stages=fe.num_stages,
                      stage_max_tokens=fe.max_tokens_limit,
                      template_kwargs=None if fe.template_vars is None else tuple(sorted(fe.template_vars - RENDER_PARAMS)))
        return JSONResponse(openapi_spec(fe.model, facts))

