"""A number read from a client, the CLI or a deploy is ASCII digits: str.isdigit() also takes "①" or "²",
which int() then refuses with a ValueError (a 500 on the wire, a traceback at load) instead of the
check's own error naming the field."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from starlette.requests import Request

from omni import config as cfg
from omni import config_vllm_omni as vo
from omni.api.errors import APIError
from omni.api.listing import list_params
from omni.digits import ascii_int
from omni.errors import ConfigError
from omni.media_settings import ImageSettings, validate_images
from omni.transport.base import TransportError
from omni.transport.util import split_endpoint

ODD = ["①", "²", "٣"]   # isdigit() all; int() refuses the first two and reads the third as 3


def test_ascii_int_reads_ascii_digits_only():
    assert [ascii_int(s) for s in ("0", "007", "65535")] == [0, 7, 65535]
    assert [ascii_int(s) for s in [*ODD, "", "-1", "+1", " 1", "1 ", "1_000", "1.0", "0x1"]] == [None] * 11
    assert ascii_int("9" * 4300) == 10 ** 4300 - 1 and ascii_int("9" * 4301) is None   # int() refuses the last


@pytest.mark.parametrize("raw", [*ODD, "1" * 5000])   # the last: more digits than int() reads
def test_a_list_limit_in_other_digits_is_a_400_naming_limit(raw):
    request = Request({"type": "http", "query_string": f"limit={quote(raw)}".encode(), "headers": []})
    with pytest.raises(APIError) as e:
        list_params(request, "job")
    assert e.value.status == 400 and e.value.param == "limit"


@pytest.mark.parametrize("raw", ODD)
def test_stage_override_keys_in_other_digits_are_refused_by_name(raw):
    data, overrides = {"stages": [{"stage_id": 0}]}, {raw: {"async_chunk": True}}
    assert vo.lift_override_chunk(data, overrides, "x.yaml") == (overrides, "x.yaml")   # not a stage id: left
    with pytest.raises(ConfigError, match="--stage-overrides: key"):
        cfg.apply_stage_overrides(data, {"①": {"max_model_len": 8}})


@pytest.mark.parametrize("raw", ODD)
def test_connector_edges_in_other_digits_are_refused_by_name(raw):
    with pytest.raises(ConfigError, match="must be from_stage_N"):
        vo._edge_stage(f"from_stage_{raw}", "from_stage_", "stages[0].input_connectors")
    bad = {"model": "m", "stages": [
        {"stage_id": 0, "engine": "torch_lm", "connectors": {raw: {"transport": "shm"}}},
        {"stage_id": 1, "engine": "pooler", "inputs": [0], "final_output": True, "final_output_type": "embedding"}]}
    with pytest.raises(ConfigError, match=r"stages\[0\].connectors: .* is not a stage id"):
        cfg.parse(bad, source="x.yaml")


@pytest.mark.parametrize("raw", ODD)
def test_an_image_default_size_in_other_digits_is_refused_by_name(raw):
    with pytest.raises(ConfigError, match="default_size"):
        validate_images(ImageSettings(default_size=f"{raw}6x16"), "images")


@pytest.mark.parametrize("raw", [*ODD, "1" * 5000])
def test_an_endpoint_port_in_other_digits_is_a_transport_error(raw):
    with pytest.raises(TransportError, match="expected host:port"):
        split_endpoint(f"127.0.0.1:{raw}")
