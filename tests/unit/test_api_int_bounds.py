"""Every integer field of every request body is bounded: a value past int64 is a 400 naming the field, never
the 500 of encoding it for a stage (msgpack carries -2**63 .. 2**64-1; the fake encodes each request as the
stage channel does). The fields are found from the route table's body types, so a new one without a bound
fails here."""

from __future__ import annotations

import copy

import httpx
import msgspec
import pytest

from omni.api import build_app
from omni.api.job_store import LocalKv, Results
from omni.api.jobs import Jobs
from omni.api.routes import ROUTES
from omni.config import ImageSettings, VideoSettings
from tests.unit.api_fakes import FakeOrchestrator, chat_body, tokenizer  # noqa: F401

pytestmark = pytest.mark.anyio
TI = msgspec.inspect

BASES = {
    "/v1/chat/completions": chat_body(),
    "/v1/completions": {"model": "tiny", "prompt": "say hello"},
    "/tokenize": {"model": "tiny", "prompt": "say hello"},
    "/detokenize": {"model": "tiny", "tokens": [1]},
    "/v1/audio/speech": {"model": "tiny", "input": "hello", "voice": "joe"},
    "/v1/images/generations": {"model": "tiny", "prompt": "a cat"},
    "/v1/videos": {"model": "tiny", "prompt": "a cat"},
    "/v1/audio/voices": {"name": "mine", "base": "joe"},
    "/v1/omni/sleep": {},
    "/v1/omni/wakeup": {},
    "/v1/omni/jobs": {"endpoint": "/v1/completions", "body": {"prompt": "say hello"}},
}
# Where a list's element goes, after fillers: sampling_params_list's entry 2 is the vocoder's, which
# skips the max_tokens cap (81d8ce4).
AT = {"sampling_params_list": (2, {})}


class EncodingOrchestrator(FakeOrchestrator):
    async def generate(self, request):
        msgspec.msgpack.encode(request)   # what the stage channel does with it
        async for out in super().generate(request):
            yield out


def int_paths(t, path=(), seen=()):
    """Every (field, index, ...) path in `t` that holds an integer."""
    if isinstance(t, TI.Metadata):
        t = t.type
    if isinstance(t, TI.IntType):
        yield path
    elif isinstance(t, TI.UnionType):
        for u in t.types:
            yield from int_paths(u, path, seen)
    elif isinstance(t, (TI.ListType, TI.VarTupleType)):
        yield from int_paths(t.item_type, (*path, 0), seen)
    elif isinstance(t, TI.StructType) and t.cls not in seen:
        for f in t.fields:
            yield from int_paths(f.type, (*path, f.encode_name), (*seen, t.cls))


def with_value(base: dict, path: tuple, value) -> dict:
    body = copy.deepcopy(base)
    node, key = body, path[0]
    for nxt in path[1:]:
        if isinstance(nxt, int):
            i, filler = AT.get(key, (0, None))
            child = [copy.deepcopy(filler) for _ in range(i)] + [None]
            nxt = i
        else:
            child = {}
        node[key] = child
        node, key = child, nxt
    node[key] = value
    return body


def name(path: tuple) -> str:
    """The path as an error's param names it: sampling_params_list[2].max_tokens."""
    out = key = path[0]
    for p in path[1:]:
        if isinstance(p, int):
            out += f"[{AT.get(key, (0,))[0]}]"
        else:
            out, key = f"{out}.{p}", p
    return out


CASES = [(r.path, path) for r in ROUTES if r.body is not None
         for path in int_paths(TI.type_info(r.body))]


def test_every_body_route_has_a_base_and_integer_fields_are_found():
    assert set(BASES) == {r.path for r in ROUTES if r.body is not None}
    found = {name(p) for route, p in CASES if route == "/v1/chat/completions"}
    assert {"top_k", "seed", "min_tokens", "stop_token_ids[0]", "sampling_params_list[2].max_tokens"} <= found


@pytest.fixture
def client(tokenizer, tmp_path):  # noqa: F811
    orch = EncodingOrchestrator(tokenizer)
    orch.audio_chunks = 1
    jobs = Jobs(LocalKv(), Results(str(tmp_path)))
    app = build_app(orch, tokenizer, served_model_name="tiny", max_model_len=128, speech_entry_stage=1,
                    num_stages=3, speakers=("joe",), jobs=jobs, images=ImageSettings(), videos=VideoSettings())
    app.state.frontend.stage_engines = {0: "vllm", 1: "piper_talker", 2: "piper_code2wav"}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("route,path", CASES, ids=[f"{r}:{name(p)}" for r, p in CASES])
@pytest.mark.parametrize("value", [2**63, 2**64, -(2**64)], ids=["2**63", "2**64", "-2**64"])
async def test_an_integer_past_int64_is_a_400_naming_the_field(client, route, path, value):
    r = await client.post(route, json=with_value(BASES[route], path, value))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in (name(path), path[0]), err


@pytest.mark.parametrize("body", [
    chat_body(top_k=2**63 - 1, seed=2**63 - 1, min_tokens=2**63 - 1),   # stop_token_ids: the vocabulary bounds them
    chat_body(seed=-(2**63)),
    chat_body(modalities=["text", "audio"], sampling_params_list=[{"max_tokens": 5}, {}, {"max_tokens": 2**63 - 1}]),
])
async def test_int64_itself_still_reaches_the_stage(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
