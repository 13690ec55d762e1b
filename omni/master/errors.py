"""Control-plane errors and the one place gRPC status codes become omni errors (client side)."""

from __future__ import annotations

import grpc

from omni.errors import BadRequest, ConfigError, NotFound, OmniError, RequestTimeout, Unavailable


class Unauthenticated(OmniError):
    """The master refused the token (missing or wrong --omni-token / OMNI_TOKEN)."""

    http_status = 401
    error_type = "authentication_error"


# Trailing metadata of the master's RESOURCE_EXHAUSTED for a KV namespace at its limit (the caller's to fix);
# gRPC's own (a message over the receive limit) and a registry at its limit are not the caller's.
KV_FULL = ("omni-error", "kv-full")
# An older master (before e7ea975) marks none: its KvFull messages, as the new one's, start so (omni/master/kv.py),
# and gRPC's own ("Received message larger than max") and the registry's ("the master holds") do not.
KV_FULL_TEXTS = ("kv namespace ", "the kv store ")


def _kv_full(err: grpc.RpcError) -> bool:
    try:
        return any(tuple(item) == KV_FULL for item in err.trailing_metadata() or ())
    except Exception:   # an error made without a call (a test double, a local failure)
        return False


class ClosedByMaster(Unavailable):
    """The master took the TCP connection and closed it in the handshake: plaintext to a TLS master, or
    no (or an unaccepted) client certificate for an mTLS one. A master still starting may do it once."""


def from_rpc_error(err: grpc.RpcError, address: str, streaming: bool = False) -> OmniError:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code is grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"cannot reach the omni master at {address}: {details}")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        if streaming:
            return RequestTimeout(f"omni master at {address}: deadline exceeded")
        return Unavailable(f"cannot reach the omni master at {address}: no answer before the deadline")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(f"omni master at {address} refused the call: {details}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return ConfigError(details)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return BadRequest(details)
    if code is grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if (code is grpc.StatusCode.RESOURCE_EXHAUSTED and not streaming
            and (_kv_full(err) or details.startswith(KV_FULL_TEXTS))):
        return BadRequest(details)   # a KV namespace at its limit: the message names it (HTTP 400)
    name = code.name if code is not None else "UNKNOWN"
    return OmniError(f"omni master at {address}: {name}: {details}")
