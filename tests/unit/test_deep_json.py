"""Deeply nested JSON is the sender's error: msgspec and json raise RecursionError past Python's
recursion limit, not a decode error, and it became a 500 with a traceback logged per request (the
frontend) or an unhandled error (the master)."""

from __future__ import annotations

import logging

import grpc
import pytest

from omni._proto import master_pb2 as pb
from omni._proto import master_pb2_grpc as pb_grpc
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from tests.unit.api_fakes import assert_error, make, tokenizer  # noqa: F401 (fixture)

DEPTH = 100_000
LISTS = "[" * DEPTH + "]" * DEPTH
OBJECTS = '{"a":' * DEPTH + "1" + "}" * DEPTH


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template_kwargs": {"x": %s}}' % LISTS),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "zzz": %s}' % OBJECTS),
    ("/tokenize", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                  '"chat_template_kwargs": {"x": %s}}' % OBJECTS),
])
async def test_deeply_nested_json_is_a_400_without_a_traceback(tokenizer, anyio_backend, path, body, caplog):
    _, c = make(tokenizer)
    with caplog.at_level(logging.ERROR):
        r = await c.post(path, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400, contains="JSON nested too deeply")
    assert err["type"] == "invalid_request_error"
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text


CFG = {"model": "m", "stages": [{"stage_id": 0, "name": "a"}]}


@pytest.fixture
def stub():
    server = MasterServer(CFG, hash_config(CFG), lease_ttl_s=5.0)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield pb_grpc.MasterStub(channel)
    finally:
        channel.close()
        server.stop(grace=0.2)


def _refused(fn) -> str:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    return e.value.details()


def test_a_deeply_nested_pipeline_config_is_invalid_argument(stub):
    says = _refused(lambda: stub.Register(pb.RegisterRequest(role=pb.FRONTEND, host="h", pid=1,
                                                             pipeline_config_json='{"x": %s}' % LISTS)))
    assert "pipeline_config_json is not valid JSON: nested too deeply" in says, says


def test_deeply_nested_command_args_are_invalid_argument(stub):
    says = _refused(lambda: stub.SendCommand(pb.SendCommandRequest(kind=pb.DRAIN, timeout_s=1.0, args_json=OBJECTS)))
    assert "args_json is not valid JSON" in says, says
