"""omni's error tree. Map to HTTP / gRPC codes only at the edges."""

from __future__ import annotations


class OmniError(Exception):
    """Base of every error omni raises on purpose."""

    http_status = 500
    error_type = "internal_error"


class ConfigError(OmniError):
    """Bad deploy config or CLI flags; the message names the key or flag."""

    http_status = 400
    error_type = "invalid_request_error"


class BadRequest(OmniError):
    http_status = 400
    error_type = "invalid_request_error"


class NotFound(OmniError):
    http_status = 404
    error_type = "not_found_error"


class Unavailable(OmniError):
    """Recoverable: no READY replica, master unreachable, sleeping engine."""

    http_status = 503
    error_type = "service_unavailable"


class StageFailed(OmniError):
    """A stage replica failed a request (or died holding it)."""

    http_status = 500
    error_type = "stage_error"

    def __init__(self, stage_id: int, replica_id: str, message: str):
        super().__init__(f"stage {stage_id} replica {replica_id}: {message}")
        self.stage_id = stage_id
        self.replica_id = replica_id


class RequestTimeout(OmniError):
    http_status = 504
    error_type = "timeout"
