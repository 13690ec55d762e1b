"""A job's body is refused at submit exactly as its route refuses it before running anything: a field the
route refuses by name (best_of, n, a TTS field in chat, speech's ref_audio ...), a range, the model name,
the voice. They were a 200 and then a failed job, as the job check only decoded the body."""

from __future__ import annotations

import httpx
import pytest

from omni.api import build_app
from omni.api.jobs import Jobs, LocalKv, Results
from omni.config import ImageSettings
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SPEECH, IMAGES = "/v1/audio/speech", "/v1/images/generations"
SPEECH_BODY = {"model": "tiny", "input": "Hello there.", "voice": "joe"}
TEXT_BODY = {"model": "tiny", "prompt": "say hello"}
IMAGE_BODY = {"model": "tiny", "prompt": "a cat"}

CASES = [
    (CHAT, chat_body(best_of=2), "best_of"),
    (CHAT, chat_body(n=2), "n"),
    (CHAT, chat_body(ref_audio="data:audio/wav;base64,AAAA"), "ref_audio"),
    (CHAT, chat_body(task_type="Base"), "task_type"),
    (CHAT, chat_body(guided_json={"type": "object"}), "guided_json"),
    (CHAT, chat_body(min_p=0.5), "min_p"),
    (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, chat_body(temperature=-1), "temperature"),
    (CHAT, chat_body(modalities=["video"]), "modalities[0]"),
    (CHAT, chat_body(modalities=["audio"], audio={"voice": "nobody"}), "audio.voice"),
    (CHAT, chat_body(model="nope"), "model"),
    (CHAT, chat_body(max_tokens=1000), "max_tokens"),        # past the context, known once templated
    (COMPLETIONS, {**TEXT_BODY, "best_of": 3}, "best_of"),
    (COMPLETIONS, {**TEXT_BODY, "n": 2}, "n"),
    (COMPLETIONS, {**TEXT_BODY, "echo": True}, "echo"),
    (COMPLETIONS, {**TEXT_BODY, "use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {**TEXT_BODY, "prompt": ""}, "prompt"),
    (COMPLETIONS, {**TEXT_BODY, "prompt": [10**6]}, "prompt"),
    (SPEECH, {**SPEECH_BODY, "ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio"),
    (SPEECH, {**SPEECH_BODY, "language": "de"}, "language"),
    (SPEECH, {**SPEECH_BODY, "input": " "}, "input"),
    (SPEECH, {**SPEECH_BODY, "speed": 9}, "speed"),
    (SPEECH, {**SPEECH_BODY, "voice": "nobody"}, "voice"),
    (SPEECH, {**SPEECH_BODY, "model": "nope"}, "model"),
    (IMAGES, {**IMAGE_BODY, "output_format": "jpeg"}, "output_format"),
]


@pytest.fixture
def client(tokenizer, tmp_path):  # noqa: F811
    jobs = Jobs(LocalKv(), Results(str(tmp_path)))
    app = build_app(FakeOrchestrator(tokenizer), tokenizer, served_model_name="tiny", max_model_len=128,
                    speech_entry_stage=1, speakers=("joe",), jobs=jobs, images=ImageSettings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"), jobs


def test_every_endpoint_jobs_take_is_covered(client):
    _, jobs = client
    assert set(jobs.handlers) == {route for route, _, _ in CASES}


@pytest.mark.parametrize("route,body,param", CASES, ids=[f"{r}:{p}" for r, _, p in CASES])
async def test_a_refused_field_is_refused_at_submit_as_the_route_refuses_it(client, route, body, param):
    c, jobs = client
    direct = await c.post(route, json=body)
    assert direct.status_code in (400, 404), direct.text
    want = direct.json()["error"]
    assert param in want["param"], want
    r = await c.post("/v1/omni/jobs", json={"endpoint": route, "body": body})
    assert r.status_code == direct.status_code, r.text
    got = r.json()["error"]
    assert got == {**want, "message": f"body: {want['message']}", "param": f"body.{want['param']}"}
    assert jobs._tasks == {} and (await c.get("/v1/omni/jobs")).json()["data"] == []


async def test_a_body_the_route_takes_is_still_a_job(client):
    c, jobs = client
    for route, body in ((CHAT, chat_body()), (COMPLETIONS, TEXT_BODY), (SPEECH, SPEECH_BODY)):
        r = await c.post("/v1/omni/jobs", json={"endpoint": route, "body": body})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
