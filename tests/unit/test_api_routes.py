"""The one route table: Starlette's routes, metric labels, the control guard and the OpenAPI
description all come from it."""

from __future__ import annotations

from omni.api import build_app, unsupported
from omni.api.openapi import oas_path
from omni.api.routes import CONTROL_PATHS, ROUTES, label, openapi_spec
from tests.unit.api_fakes import FakeOrchestrator, tokenizer  # noqa: F401 (fixture)


def test_labels_name_the_template_not_the_id():
    assert label("/v1/chat/completions") == "/v1/chat/completions"
    assert label("/v1/audio/voices/alice") == "/v1/audio/voices/{name}"
    assert label("/v1/omni/jobs/job-1") == "/v1/omni/jobs/{job_id}"
    assert label("/v1/omni/jobs/job-1/content") == "/v1/omni/jobs/{job_id}/content"
    assert label("/v1/omni/jobs/job-1/other") == "other" and label("/secret/123") == "other"
    assert label("/v1/models/Qwen/Qwen3-Omni") == "/v1/models/{model}"    # as openapi.json names it


def test_app_openapi_and_guard_follow_the_table(tokenizer):
    app = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=64,
                    speech_entry_stage=1)
    refused = {r.path for r in unsupported.routes()}   # vllm-omni's endpoints refused by name, not served
    served = {(r.path, m) for r in app.routes if r.path not in refused for m in r.endpoint.methods}
    table = {(r.path, r.method) for r in ROUTES}
    assert served == table
    spec = openapi_spec("tiny")["paths"]
    assert {(p, m.upper()) for p, ops in spec.items() for m in ops} == {(oas_path(p), m) for p, m in table}
    assert "requestBody" in spec["/v1/chat/completions"]["post"]
    assert CONTROL_PATHS == {"/v1/omni/sleep", "/v1/omni/wakeup", "/sleep", "/wake_up"}
    assert set(app.state.jobs.handlers) == {"/v1/chat/completions", "/v1/completions", "/v1/audio/speech"}
    text_only = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=64)
    assert set(text_only.state.jobs.handlers) == {"/v1/chat/completions", "/v1/completions"}


def test_each_list_route_documents_the_query_parameters_it_takes():
    """GET /v1/omni/jobs documented `limit` only, while it takes OpenAI's `order` and `after` too."""
    from omni.api.listing import PARAMS

    spec = openapi_spec("tiny")["paths"]
    for path in ("/v1/omni/jobs", "/v1/videos"):
        params = spec[path]["get"]["parameters"]
        assert [p["name"] for p in params if p["in"] == "query"] == list(PARAMS), path
