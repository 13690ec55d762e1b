"""OpenAI-shaped error bodies, and the mapping from omni's error tree to HTTP."""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.responses import Response

from omni import errors
from omni.errors import OmniError, StageFailed

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the frontend answers with directly (bad input, unknown model, auth)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx/5xx body (OpenAI's shape); openapi.json's error schema is generated from it."""
    error: ErrorDetail


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return msgspec.to_builtins(ErrorResponse(ErrorDetail(message, type, param, code)))


def error_response(status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> Response:
    body = ErrorResponse(ErrorDetail(message, type, param, code))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


# The one place an omni error kind becomes an HTTP status and an OpenAI error type.
HTTP_BY_KIND = {
    errors.CLIENT: (400, "invalid_request_error"),
    errors.NOT_FOUND: (404, "not_found_error"),
    errors.CONFLICT: (409, "conflict_error"),
    errors.UNAVAILABLE: (503, "service_unavailable"),
    errors.TIMEOUT: (504, "timeout"),
    errors.INTERNAL: (500, "internal_error"),
}


_EXC_PREFIX = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): ")   # the stage worker's "EngineError: "


def engine_sentence(exc: StageFailed) -> str | None:
    """A refusal by the stage that read the client's own input (the request's entry stage), in the engine's
    words: without the worker's "EngineError: " and the engine's "request <this request's id>: ". None for
    a later stage: what it refused came from another stage, so where it failed is the news."""
    if exc.entry_rid is None:
        return None
    out = _EXC_PREFIX.sub("", exc.detail, count=1)
    for prefix in (f"request {exc.entry_rid}: ", f"request {exc.entry_rid!r}: "):
        out = out.removeprefix(prefix)
    return out or exc.detail


def to_api_error(exc: BaseException) -> APIError:
    """Any exception -> APIError; unexpected ones become a 500 without a traceback in the body."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OmniError):
        status, type_ = HTTP_BY_KIND.get(exc.kind, HTTP_BY_KIND[errors.INTERNAL])
        if isinstance(exc, StageFailed) and exc.kind == errors.INTERNAL:
            type_ = "stage_error"
        if isinstance(exc, StageFailed) and exc.kind == errors.CLIENT:
            sentence = engine_sentence(exc)
            if sentence is not None:
                # Which replica, the exception's class and the internal request id are for the operator.
                log.info("request refused by %s", exc)
                return APIError(status, sentence, type=type_, param=getattr(exc, "param", None))
            log.warning("request refused by %s (past its entry stage: the input came from another stage)", exc)
        return APIError(status, str(exc) or type(exc).__name__, type=type_, param=getattr(exc, "param", None))
    log.exception("unexpected error while serving a request")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")


def api_error_response(exc: BaseException) -> Response:
    e = to_api_error(exc)
    return error_response(e.status, e.message, e.type, e.param, e.code)
