"""OpenAI's list parameters (`limit`, `order`, `after`) for the job and video lists; any other query
parameter is refused by name (it was ignored: `GET /v1/omni/jobs?after=...` gave the first page).

Job ids sort as their jobs were made, newest first (`job_id`), so a page is the next `limit` keys of
the master's KV after the cursor, not the whole namespace (10,000 records, up to 64 MiB, per call)."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request

from omni.api.errors import APIError, bad_request
from omni.digits import ascii_int

PARAMS = ("limit", "order", "after")
# Their OpenAPI description (omni/api/routes.py), one for both lists.
QUERY = (("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
         ("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}),
         ("after", {"type": "string"}))
# An id made before ids sorted by time: uuid4's hex (version 4, variant 10xx). A new id's 17th digit is 0.
LEGACY_ID_RE = re.compile(r"[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}")
NS_MAX = (1 << 64) - 1


def job_id(prefix: str, created_ns: int) -> str:
    """`prefix` + 32 hex digits: the creation time counted down (a later job sorts first), then random."""
    return f"{prefix}{NS_MAX - created_ns:016x}0{uuid.uuid4().hex[:15]}"


def order_key(job_id: str) -> str:
    return job_id[-32:]


def is_legacy(job_id: str) -> bool:
    return LEGACY_ID_RE.fullmatch(order_key(job_id)) is not None


def list_params(request: Request, what: str) -> tuple[int, str, str | None]:
    """(limit, order, after) of a list request, each checked."""
    q = request.query_params
    unknown = sorted(set(q) - set(PARAMS))
    if unknown:
        raise bad_request(f"unknown query parameter {unknown[0]!r}: a {what} list takes {', '.join(PARAMS)}",
                          param=unknown[0])
    for name in PARAMS:
        if len(q.getlist(name)) > 1:
            raise bad_request(f"query parameter {name!r} is given {len(q.getlist(name))} times", param=name)
    raw = q.get("limit", "20")
    limit = ascii_int(raw) or 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit={raw[:20]} must be an integer in [1, 100]", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order={order} must be asc or desc", param="order")
    return limit, order, q.get("after")


def no_such_cursor(after: str, what: str) -> APIError:
    # a cursor naming nothing: not found (a well-formed request, so not a 400)
    return APIError(404, f"after={after} is no {what} in this list", param="after", code="not_found")


def page(items: list[dict], limit: int, what: str) -> dict:
    """An OpenAI list object of the first `limit` of `items` (those after the cursor, in order)."""
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def list_page(request: Request, items: list[dict], what: str) -> dict:
    """One page of `items` (newest first) as an OpenAI list object."""
    limit, order, after = list_params(request, what)
    if order == "asc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise no_such_cursor(after, what)
        items = items[ids.index(after) + 1:]
    return page(items, limit, what)
