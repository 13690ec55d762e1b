"""OpenAI's list parameters (`limit`, `order`, `after`) for the job and video lists; any other query
parameter is refused by name (it was ignored: `GET /v1/omni/jobs?after=...` gave the first page)."""

from __future__ import annotations

from starlette.requests import Request

from omni.api.errors import APIError, bad_request

PARAMS = ("limit", "order", "after")
# Their OpenAPI description (omni/api/routes.py), one for both lists.
QUERY = (("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
         ("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}),
         ("after", {"type": "string"}))


def list_page(request: Request, items: list[dict], what: str) -> dict:
    """One page of `items` (newest first) as an OpenAI list object."""
    q = request.query_params
    unknown = sorted(set(q) - set(PARAMS))
    if unknown:
        raise bad_request(f"unknown query parameter {unknown[0]!r}: a {what} list takes {', '.join(PARAMS)}",
                          param=unknown[0])
    for name in PARAMS:
        if len(q.getlist(name)) > 1:
            raise bad_request(f"query parameter {name!r} is given {len(q.getlist(name))} times", param=name)
    raw = q.get("limit", "20")
    limit = int(raw) if raw.isdigit() else 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit={raw} must be an integer in [1, 100]", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order={order} must be asc or desc", param="order")
    if order == "asc":
        items = items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:   # a cursor naming nothing: not found (a well-formed request, so not a 400)
            raise APIError(404, f"after={after} is no {what} in this list", param="after", code="not_found")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
