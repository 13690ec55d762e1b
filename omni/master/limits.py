"""Checks and size limits on what a registrant or a heartbeat puts into the registry.

Every replica's entry goes out whole in GetStatus and each WatchTopology snapshot, so one token holder's
3 MiB capability made those answers pass the clients' receive limit for everyone. A real stage sends 2
endpoints, 4 capabilities and ~45 extra gauges (the step histograms, one per bucket), far inside these;
with the registry's entry cap (`MAX_ENTRIES_PER_ROLE`) the largest status stays under the clients'
`MAX_RECEIVE_BYTES`.
"""

from __future__ import annotations

import json
import math
from typing import Mapping

from omni._proto import master_pb2 as pb

MAX_HOST_BYTES = 255                 # a DNS name's length
MAX_VERSION_BYTES = 255
MAX_INSTANCE_ID_BYTES = 64           # MasterClient sends a uuid4's 32 hex digits
MAX_CONFIG_HASH_BYTES = 128          # omni.config.config_hash is 16 hex digits; room for a longer digest
MAX_MAP_ENTRIES = 64                 # endpoints, capabilities
MAX_ITEM_BYTES = 1024                # each key and each value of those
MAX_REGISTRATION_BYTES = 8192        # host, version, endpoints and capabilities together
MAX_EXTRA_ENTRIES = 256              # a heartbeat's extra gauges
MAX_EXTRA_KEY_BYTES = 256
MAX_EXTRA_BYTES = 8192               # its keys together
MAX_CONFIG_BYTES = 1 << 20           # pipeline_config_json
MAX_ENTRIES_PER_ROLE = 256           # live and DEAD entries of stages, and of frontends
MAX_RECEIVE_BYTES = 32 << 20         # the clients' receive limit (gRPC's default: 4 MiB)
# Clients ping an idle channel this often, so a dead master is seen without a call waiting on it. The
# server must allow it: gRPC's default (no pings without a call, none under 5 min without data) answers
# the third with a GOAWAY "too_many_pings", and a call then on the connection fails.
KEEPALIVE_MS = 10_000
# What the master's server allows a connection (docs/security.md). A legitimate process holds at most 3 long calls
# (KeepAlive, the watches) on its one connection, its other calls take under a millisecond, and calls past the cap
# wait on the client for a slot; so 100 (HTTP/2's recommended least) bounds a token holder's buffered requests to
# 100 x MAX_REQUEST_BYTES a connection. The largest legitimate request is a 3 MiB metrics value (kv.LIMITS).
MAX_STREAMS_PER_CONNECTION = 100
MAX_REQUEST_BYTES = 4 << 20          # gRPC's default, stated
# A connection with no call open is closed (a graceful GOAWAY: a client reconnects at its next call) after
# MAX_IDLE_MS, and one open longer than MAX_AGE_MS takes no new call (its open calls run on, so a stage's KeepAlive
# is never cut): a peer without the token, every call of which is refused at once, is held no longer.
MAX_IDLE_MS = 30_000
MAX_AGE_MS = 600_000
HANDSHAKE_TIMEOUT_MS = 20_000        # TCP to HTTP/2 settings (TLS included); gRPC's default is 120 s


def _size(text: str) -> int:
    return len(text.encode())


def _check_map(name: str, items: Mapping[str, str]) -> str | None:
    if len(items) > MAX_MAP_ENTRIES:
        return f"{name}: {len(items)} entries, at most {MAX_MAP_ENTRIES}"
    for key, value in items.items():
        if _size(key) > MAX_ITEM_BYTES or _size(value) > MAX_ITEM_BYTES:
            return f"{name}[{key[:64]!r}]: key and value at most {MAX_ITEM_BYTES} bytes each"
    return None


def registration_problem(host: str, version: str, endpoints: Mapping[str, str], capabilities: Mapping[str, str],
                         config_json: str, instance_id: str = "", config_hash: str = "") -> str | None:
    """What is too large in a RegisterRequest, naming the field; None when it fits. The instance id is kept in
    each entry, and the first registrant's config_hash, when the master has none, goes out in every GetStatus."""
    for name, text, cap in (("host", host, MAX_HOST_BYTES), ("version", version, MAX_VERSION_BYTES),
                            ("instance_id", instance_id, MAX_INSTANCE_ID_BYTES),
                            ("config_hash", config_hash, MAX_CONFIG_HASH_BYTES)):
        if _size(text) > cap:
            return f"{name}: {_size(text)} bytes, at most {cap}"
    for name, items in (("endpoints", endpoints), ("capabilities", capabilities)):
        problem = _check_map(name, items)
        if problem:
            return problem
    total = _size(host) + _size(version) + sum(_size(k) + _size(v) for m in (endpoints, capabilities)
                                                for k, v in m.items())
    if total > MAX_REGISTRATION_BYTES:
        return (f"host, version, endpoints and capabilities: {total} bytes together, "
                f"at most {MAX_REGISTRATION_BYTES}")
    if _size(config_json) > MAX_CONFIG_BYTES:
        return f"pipeline_config_json: {_size(config_json)} bytes, at most {MAX_CONFIG_BYTES}"
    return None


def extra_problem(extra: Mapping[str, float]) -> str | None:
    """What is too large in a heartbeat's extra; None when it fits."""
    if len(extra) > MAX_EXTRA_ENTRIES:
        return f"heartbeat extra: {len(extra)} entries, at most {MAX_EXTRA_ENTRIES}"
    for key in extra:
        if _size(key) > MAX_EXTRA_KEY_BYTES:
            return f"heartbeat extra[{key[:64]!r}]: key over {MAX_EXTRA_KEY_BYTES} bytes"
    total = sum(_size(k) for k in extra)
    if total > MAX_EXTRA_BYTES:
        return f"heartbeat extra: keys of {total} bytes together, at most {MAX_EXTRA_BYTES}"
    return None


def parse_register(request: pb.RegisterRequest) -> tuple[dict | None, str | None]:
    """The request's pipeline config (None: it sent none), or what is wrong with the request, naming the field."""
    problem = registration_problem(request.host, request.version, request.endpoints, request.capabilities,
                                   request.pipeline_config_json, request.instance_id, request.config_hash)
    if problem:   # every entry goes out whole in each GetStatus and topology snapshot
        return None, problem
    try:
        cfg = json.loads(request.pipeline_config_json) if request.pipeline_config_json else None
    except ValueError as e:
        return None, f"pipeline_config_json is not valid JSON: {e}"
    except RecursionError:
        return None, "pipeline_config_json is not valid JSON: nested too deeply"
    if cfg is not None and not isinstance(cfg, dict):
        return None, f"pipeline_config_json must be a JSON object, got {type(cfg).__name__}"
    if request.role == pb.ROLE_UNSPECIFIED:
        return None, "role is required (STAGE or FRONTEND)"
    if request.role not in (pb.STAGE, pb.FRONTEND):
        return None, f"role must be STAGE or FRONTEND, got {request.role}"
    return cfg, None


def command_timeout(timeout_s: float) -> str | None:
    """What is wrong with a SendCommand's timeout_s (0: the default), or None. NaN and negative waited
    for no ack after the command had gone out: the replicas drained, the answer said timeout."""
    if not math.isfinite(timeout_s) or timeout_s < 0:
        return f"timeout_s must be a finite number of seconds >= 0 (0: the default), got {timeout_s}"
    return None
