"""omni's error tree. Each error says its kind; HTTP (omni/api/errors.py) and gRPC codes
are chosen from the kind at the edges only."""

from __future__ import annotations

# The kinds of failure, as the stage channel (RequestError.kind) and the API edge name them.
CLIENT = "client"            # the request itself is wrong; sending it again will not help
NOT_FOUND = "not_found"      # it names something that does not exist
CONFLICT = "conflict"        # well formed, but the state of what it names refuses it (a duplicate)
UNAVAILABLE = "unavailable"  # recoverable: no READY replica, master unreachable, draining, sleeping
TIMEOUT = "timeout"          # a deadline passed
INTERNAL = "internal"        # a bug or a broken component
KINDS = (CLIENT, NOT_FOUND, CONFLICT, UNAVAILABLE, TIMEOUT, INTERNAL)


class OmniError(Exception):
    """Base of every error omni raises on purpose."""

    kind = INTERNAL


class ConfigError(OmniError):
    """Bad deploy config or CLI flags; the message names the key or flag."""

    kind = CLIENT


class BadRequest(OmniError):
    kind = CLIENT


class NotFound(OmniError):
    kind = NOT_FOUND


class Conflict(OmniError):
    kind = CONFLICT


class Unavailable(OmniError):
    """Recoverable: no READY replica, master unreachable, sleeping engine."""

    kind = UNAVAILABLE


class StageFailed(OmniError):
    """A stage replica failed a request (or died holding it); `kind` is the stage's word
    for it (a request the engine refused is a client error, a dead replica unavailable).
    `entry_rid`: the request's id when the stage is its entry stage, the one that read the client's own
    input (set by the orchestrator); a later stage's input was another stage's output."""

    def __init__(self, stage_id: int, replica_id: str, message: str, kind: str = INTERNAL, *,
                 entry_rid: str | None = None):
        super().__init__(f"stage {stage_id} replica {replica_id}: {message}")
        self.detail = message       # the stage's own words, without where they came from
        self.stage_id = stage_id
        self.replica_id = replica_id
        self.kind = kind if kind in KINDS else INTERNAL
        self.entry_rid = entry_rid


class RequestTimeout(OmniError):
    kind = TIMEOUT
