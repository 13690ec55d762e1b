"""A web page in the operator's browser can send "simple" cross-site requests to a frontend on
127.0.0.1 (omni/api/browser.py): a POST with no body, or a text/plain or form body, with the page's
Origin. A keyless frontend put itself to sleep and parsed text/plain as JSON."""

from __future__ import annotations

import pytest

from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio
EVIL = {"Origin": "https://evil.example"}
JSON_BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "say hello"}]}'


@pytest.mark.parametrize("ctype", ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/omni/jobs"])
async def test_a_json_route_refuses_a_body_that_is_not_said_to_be_json(tokenizer, ctype, path):
    orch, c = make(tokenizer)
    body = JSON_BODY if path != "/v1/omni/jobs" else b'{"endpoint": "/v1/chat/completions", "body": %s}' % JSON_BODY
    r = await c.post(path, content=body, headers={} if ctype is None else {"Content-Type": ctype})
    err = assert_error(r, 400, param="Content-Type", contains="Content-Type must be application/json")
    assert err["code"] == "unsupported_media_type"
    assert (repr(ctype) if ctype else "none was sent") in err["message"]
    assert orch.requests == []


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/vnd.api+json"])
async def test_json_content_types_are_taken(tokenizer, ctype):
    _, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", content=JSON_BODY, headers={"Content-Type": ctype})
    assert r.status_code == 200, r.text


async def test_a_body_less_post_needs_no_content_type(tokenizer):
    orch, c = make(tokenizer)
    assert (await c.post("/v1/omni/sleep", headers={"Content-Type": "text/plain"})).status_code == 200
    assert orch.sleeping is True


@pytest.mark.parametrize("path, body", [("/v1/omni/sleep", None), ("/v1/omni/wakeup", None),
                                        ("/v1/chat/completions", JSON_BODY)])
@pytest.mark.parametrize("origin", ["https://evil.example", "http://test.evil.example", "http://test:8080", "null"])
async def test_a_keyless_server_refuses_a_state_change_from_another_sites_page(tokenizer, path, body, origin):
    orch, c = make(tokenizer)
    r = await c.post(path, content=body, headers={"Origin": origin, "Content-Type": "application/json"})
    err = assert_error(r, 403, param="Origin", contains="cross-site request refused")
    assert err["type"] == "permission_error" and err["code"] == "cross_site_request"
    assert "--allowed-origins" in err["message"]    # the way for a browser app of another origin
    assert orch.sleeping is False and orch.requests == []


async def test_a_delete_from_another_sites_page_is_refused(tokenizer):
    _, c = make(tokenizer)
    assert_error(await c.delete("/v1/omni/jobs/job-x", headers=EVIL), 403, param="Origin")


@pytest.mark.parametrize("headers", [{}, {"Origin": "http://test"}, {"Origin": "http://TEST:80"},
                                     {"Origin": "https://ui.example", "X-Forwarded-Host": "ui.example"}])
async def test_same_site_and_origin_less_requests_pass(tokenizer, headers):
    orch, c = make(tokenizer)
    assert (await c.post("/v1/omni/sleep", headers=headers)).status_code == 200
    assert orch.sleeping is True


async def test_reads_from_another_site_pass_the_origin_check(tokenizer):
    _, c = make(tokenizer)      # the browser keeps the answer from the page: omni grants no CORS
    assert (await c.get("/v1/omni/is_sleeping", headers=EVIL)).status_code == 200


async def test_with_a_key_the_origin_is_not_checked(tokenizer):
    """A page cannot add the Authorization header cross-site without a preflight, which omni never grants."""
    orch, c = make(tokenizer, api_key="k")
    assert_error(await c.post("/v1/omni/sleep", headers=EVIL), 401)
    r = await c.post("/v1/omni/sleep", headers={**EVIL, "Authorization": "Bearer k"})
    assert r.status_code == 200 and orch.sleeping is True


async def test_a_control_key_guards_only_the_control_routes(tokenizer):
    orch, c = make(tokenizer, control_api_key="admin")
    r = await c.post("/v1/omni/sleep", headers={**EVIL, "Authorization": "Bearer admin"})
    assert r.status_code == 200 and orch.sleeping is True
    assert_error(await c.post("/v1/chat/completions", json=chat_body(), headers=EVIL), 403, param="Origin")


async def test_a_videos_form_is_still_taken_but_not_text(tokenizer):
    _, c = make(tokenizer)     # no video stage: the handler's 404 shows the form got past the check
    r = await c.post("/v1/videos", data={"prompt": "x"})
    assert r.status_code == 404, r.text
    r = await c.post("/v1/videos", content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert_error(r, 400, param="Content-Type", contains="or a form")
    assert_error(await c.post("/v1/videos", data={"prompt": "x"}, headers=EVIL), 403, param="Origin")
