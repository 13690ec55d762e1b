"""Every fed token's hidden rows out of vLLM (hidden_rows_layer): the capture config, the connector's
per-step schedule of positions (speculative rows included), and the engine-side RowStream that hands
out a row only once it is final. Pure: no EngineCore."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni.engines.vllm import mm as vllm_mm
from omni.errors import ConfigError

pytest.importorskip("vllm")
from omni.engines.vllm import hidden as vllm_hidden  # noqa: E402


def _hf(layers=2):
    text = SimpleNamespace(num_hidden_layers=layers)
    return SimpleNamespace(thinker_config=SimpleNamespace(text_config=text, audio_token_id=5))


def _capture(mm, rows):
    args: dict = {}
    reader = vllm_mm.enable_hidden_capture("stage 0", mm, _hf(), args, rows)
    reader.close()
    spec = args["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    return spec, args["kv_transfer_config"]["kv_connector_extra_config"]


def test_last_means_the_layer_after_the_last_and_slots_follow_vllms_sorted_order():
    ids, extra = _capture(None, "last")
    assert ids == [2] and extra["rows_slot"] == 0 and extra["mm_slot"] is None
    ids, extra = _capture(1, "last")
    assert ids == [1, 2] and (extra["mm_slot"], extra["rows_slot"]) == (0, 1)
    ids, extra = _capture(1, 0)
    assert ids == [0, 1] and (extra["mm_slot"], extra["rows_slot"]) == (1, 0)


@pytest.mark.parametrize("rows", [3, -1, True, "first"])
def test_bad_rows_layer_names_the_flag(rows):
    with pytest.raises(ConfigError) as e:
        vllm_mm.enable_hidden_capture("stage 0", None, _hf(), {}, rows)
    assert "engine_args.hidden_rows_layer" in str(e.value) and "[0, 2]" in str(e.value)


def _connector(tmp_path):
    c = object.__new__(vllm_hidden.OmniHiddenStatesConnector)
    c._cache_kv_group_id, c._storage_path, c._rows_slot = 0, str(tmp_path), 0
    c._tracked, c._rows = {}, {}
    return c


def _step(c, n, new=(), cached=None):
    cached = cached or {}
    out = SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), new_block_ids=[None] * len(cached),
                                              resumed_req_ids=set(), num_computed_tokens=list(cached.values())),
        num_scheduled_tokens=n)
    return [(r.start, r.end, r.path.rsplit("/", 1)[1]) for r in c.build_connector_meta(out).rows]


def test_the_connector_writes_every_computed_position_and_rewrites_a_rejected_draft(tmp_path):
    c = _connector(tmp_path)
    ask = SimpleNamespace(extra_args={"kv_transfer_params": {vllm_hidden.ROWS_PARAM: "r0"}})
    new = [SimpleNamespace(req_id="a", sampling_params=ask, prompt_token_ids=[1] * 40, block_ids=([3, 4],),
                           num_computed_tokens=0),
           SimpleNamespace(req_id="quiet", sampling_params=SimpleNamespace(extra_args=None),
                           prompt_token_ids=[1] * 4, block_ids=([5],), num_computed_tokens=0)]
    assert _step(c, {"a": 32, "quiet": 4}, new) == [(0, 32, "r0.0.safetensors")]     # chunked prefill
    assert _step(c, {"a": 8}, cached={"a": 32}) == [(32, 40, "r0.1.safetensors")]
    assert _step(c, {"a": 2}, cached={"a": 40}) == [(40, 42, "r0.2.safetensors")]   # fed id + its draft
    assert _step(c, {"a": 2}, cached={"a": 41}) == [(41, 43, "r0.3.safetensors")]   # draft rejected: 41 again
    assert _step(c, {"a": 2}, cached={"a": 43}) == [(43, 45, "r0.4.safetensors")]   # accepted: on from 43
    c.request_finished(SimpleNamespace(request_id="a"), None)
    assert c._rows == {}


def _write(tmp_path, stem, seq, start, rows):
    from safetensors.torch import save_file

    save_file({"rows": rows, "start": torch.tensor([start])}, str(tmp_path / f"{stem}.{seq}.safetensors"))


def test_row_stream_hands_out_only_final_rows_in_order(tmp_path):
    s = vllm_hidden.RowStream(tmp_path, "r7")
    prompt, wrong, right = torch.randn(5, 4), torch.full((1, 4), 9.0), torch.randn(3, 4)
    assert s.take(4) is None                                   # nothing written yet
    _write(tmp_path, "r7", 0, 0, prompt)
    assert torch.equal(s.take(5), prompt)                      # first output: 6 tokens -> rows [0, 5)
    _write(tmp_path, "r7", 1, 5, torch.cat([right[:1], wrong]))   # fed id at 5, its draft at 6
    got = s.take(6)                                            # 7 tokens: row 6 is not final yet
    assert torch.equal(got, right[:1]) and s.delivered == 6
    _write(tmp_path, "r7", 2, 6, right[1:])                    # the draft was rejected: 6 recomputed
    assert torch.equal(s.take(8), right[1:]) and s.delivered == 8
    assert not list(tmp_path.glob("r7.*"))                     # read files are removed
    _write(tmp_path, "r7", 3, 8, torch.randn(100, 4))          # the buffer grows
    assert s.take(108).shape == (100, 4)
    _write(tmp_path, "r7", 4, 108, torch.randn(1, 4))
    s.close()
    assert not list(tmp_path.glob("r7.*"))
