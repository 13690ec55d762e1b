"""The OpenAPI description, generated from the msgspec types that decode the request bodies
(omni/api/protocol.py), so what it says a route takes is what the route accepts; the paths come
from the route table (omni/api/routes.py)."""

from __future__ import annotations

import msgspec

REF = "#/components/schemas/{name}"


def spec(routes, title: str, version: str) -> dict:
    types = list(dict.fromkeys(r.body for r in routes if r.body is not None))
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    ref_of = dict(zip(types, refs))
    paths: dict[str, dict] = {}
    for r in routes:
        paths.setdefault(r.path, {})[r.method.lower()] = operation(ref_of.get(r.body), r.ok)
    # 3.1: its schemas are JSON Schema 2020-12, what msgspec writes (null unions as anyOf).
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


def operation(body: dict | None, ok: str = "application/json") -> dict:
    op: dict = {"responses": {"200": {"description": "OK", "content": {ok: {}}},
                              "400": {"description": "Bad request (OpenAI error body)"},
                              "503": {"description": "No READY replica, or the engines are asleep"}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op
