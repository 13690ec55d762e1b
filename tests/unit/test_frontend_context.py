"""The frontend's context limit (omni/frontend.py): the deploy's max_model_len, else the model's own
for vLLM (the bundled Qwen-Omni GPU deploys set none), then what the prompt stage's replicas register."""

from __future__ import annotations

import json
import types

import msgspec
import pytest

from omni import config as C
from omni.frontend import _max_model_len, refused_sampling
from omni.master.types import TopologyEvent
from omni.orchestrator.limits import follow_limits, replica_limits
from omni.orchestrator.topology import Topology
from tests.unit.test_orchestrator_core import replica


def _folder(tmp_path, name: str, positions: int):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"thinker_config": {"text_config": {"max_position_embeddings": positions}}}))
    return str(d)


@pytest.mark.parametrize("deploy, positions, want", [
    ("qwen3-omni-moe", 65536, 65536), ("qwen3-omni-moe-thinker-only", 65536, 65536),
    ("qwen3-omni-moe-1gpu", 65536, 16384),    # its own max_model_len
    ("qwen2.5-omni-7b", 32768, 32768), ("qwen2.5-omni-3b", 32768, 32768)])
def test_gpu_deploys_without_max_model_len_take_the_models_own(tmp_path, monkeypatch, deploy, positions, want):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    config = C.load(_folder(tmp_path, "m", positions), deploy)
    assert _max_model_len(config) == want


def test_a_model_that_is_not_at_hand_or_not_vllm_keeps_2048(tmp_path):
    stage = types.SimpleNamespace(inputs=("prompt",), engine="vllm", model=str(tmp_path / "absent"), engine_args={})
    assert _max_model_len(types.SimpleNamespace(stages=[stage], model=None)) == 2048
    stage.model, stage.engine = _folder(tmp_path, "m", 8192), "torch_lm"     # torch_lm's own default is 2048
    assert _max_model_len(types.SimpleNamespace(stages=[stage], model=None)) == 2048


# thinker -> talker -> code2wav, as follow_limits reads a deploy
PIPELINE = types.SimpleNamespace(stages=[types.SimpleNamespace(stage_id=i, inputs=inputs)
                                         for i, inputs in enumerate([("prompt",), (0,), (1,)])])


def frontend(**kw):
    return types.SimpleNamespace(**{"max_model_len": 2048, "audio_limit": None, "audio_prompt_len": None,
                                    "stage_codec_stops": {}, **kw})


def test_the_limit_follows_what_the_prompt_stages_replicas_register():
    def rep(stage_id, rid, limit=None):
        return msgspec.structs.replace(replica(stage_id, rid),
                                       capabilities={"max_model_len": str(limit)} if limit else {})
    fe = frontend()
    topo = Topology()
    follow_limits(fe, topo, PIPELINE)
    topo.apply(TopologyEvent("SNAPSHOT", [rep(0, "a"), rep(1, "t", 99_999)], 1))
    assert fe.max_model_len == 2048          # nothing registered for stage 0 yet; another stage's is not its
    topo.apply(TopologyEvent("ADDED", [rep(0, "b", 40960)], 2))
    assert fe.max_model_len == 40960
    topo.apply(TopologyEvent("ADDED", [rep(0, "c", 8192)], 3))
    assert fe.max_model_len == 40960         # the largest: a request goes to a replica it fits
    topo.apply(TopologyEvent("REMOVED", [rep(0, "b", 40960)], 4))
    assert fe.max_model_len == 8192


@pytest.mark.parametrize("deploy, refused", [
    ("qwen3-omni-moe", True), ("qwen3-omni-moe-1gpu", True), ("qwen2.5-omni-7b", True), ("qwen2.5-omni-3b", True),
    ("qwen3-omni-moe-thinker-only", False)])    # no talker: no capture, vLLM takes logit_bias
def test_logit_bias_is_refused_where_the_thinker_captures_hidden_states(tmp_path, monkeypatch, deploy, refused):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    config = C.load(_folder(tmp_path, "m", 4096), deploy)
    got = refused_sampling(config)
    assert set(got) == ({"logit_bias"} if refused else set())
    assert not refused or "speculative decoding" in got["logit_bias"]


@pytest.mark.parametrize("deploy, talker", [("qwen3-omni-moe", 1), ("qwen2.5-omni-7b", 1), ("qwen3-omni-moe-thinker-only", None)])
def test_a_talkers_refused_sampling_is_named_for_its_stage(tmp_path, monkeypatch, deploy, talker):
    from omni.frontend import refused_stage_sampling

    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    got = refused_stage_sampling(C.load(_folder(tmp_path, "m", 4096), deploy))
    assert got == ({} if talker is None else {talker: {"presence_penalty": got[talker]["presence_penalty"],
                                                       "frequency_penalty": got[talker]["frequency_penalty"]}})


def test_the_head_keeps_its_own_max_model_len():
    fe = frontend(max_model_len=1000)
    topo = Topology()
    follow_limits(fe, topo, PIPELINE, follow_context=False)
    topo.apply(TopologyEvent("SNAPSHOT", [msgspec.structs.replace(replica(0, "a"), capabilities={"max_model_len": "9"})], 1))
    assert fe.max_model_len == 1000


@pytest.mark.parametrize("deploy, tiny, edges", [("qwen3-omni-moe", "qwen3_omni", "qwen3_omni"),
                                                 ("qwen2.5-omni-7b", "qwen25_omni", "qwen25_omni")])
def test_the_load_check_reads_a_talkers_codec_stops_as_the_talker_does(tmp_path, monkeypatch, deploy, tiny, edges):
    """The codes a talker's default stop_token_ids may name, from config.json (check_talker_defaults): the
    keys the talker reads its own from (config_checks.codec_stops), the ids it stops at (TalkerIds.from_config
    of the same config); a model not at hand leaves the stage out."""
    import collections
    import importlib

    from omni.config_checks import codec_stops, stage_codec_stops

    config = importlib.import_module(f"omni.models.{tiny}.tiny").build_config(collections.defaultdict(int))
    ids = importlib.import_module(f"omni.models.{edges}.edges").TalkerIds.from_config(config)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(config.to_json_string())
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    want = {ids.codec_eos} | ({ids.codec_pad} if tiny == "qwen25_omni" else set())
    loaded = C.load(str(d), deploy)
    assert codec_stops(loaded.stages[1].engine, config.talker_config) == want
    assert stage_codec_stops(loaded) == {1: want}
    assert stage_codec_stops(C.load(_folder(tmp_path, "bare", 4096), deploy)) == {}


def test_the_audio_count_follows_what_the_prompt_stages_replicas_register():
    """A head's (or a headless replica's) own --limit-mm-per-prompt is not in the deploy config the frontend
    reads: the replicas register the count their vLLM engine read, and the largest live one is the limit;
    before any did (requests are then 503: no READY replica) there is none, whatever the deploy says."""
    def rep(stage_id, rid, engine=None):
        return msgspec.structs.replace(replica(stage_id, rid), capabilities=replica_limits(engine))
    fe = frontend()
    topo = Topology()
    follow_limits(fe, topo, PIPELINE)
    topo.apply(TopologyEvent("SNAPSHOT", [rep(1, "t", types.SimpleNamespace(audio_limit=9))], 1))
    assert fe.audio_limit is None                  # nothing live for stage 0 yet; another stage's is not its
    topo.apply(TopologyEvent("ADDED", [rep(0, "a", types.SimpleNamespace(audio_limit=2))], 2))
    assert fe.audio_limit == 2
    topo.apply(TopologyEvent("ADDED", [rep(0, "b", types.SimpleNamespace(audio_limit=0))], 3))
    assert fe.audio_limit == 2                     # the largest: the stage refuses what its replica cannot take
    topo.apply(TopologyEvent("ADDED", [rep(0, "c")], 4))
    assert fe.audio_limit is None                  # a replica that registered none: no early check
    topo.apply(TopologyEvent("REMOVED", [rep(0, "c"), rep(0, "a", types.SimpleNamespace(audio_limit=2))], 5))
    assert fe.audio_limit == 0
    topo.apply(TopologyEvent("REMOVED", [rep(0, "b")], 6))
    assert fe.audio_limit is None


def test_the_frontend_checks_a_talkers_stop_token_ids_against_what_its_replicas_register():
    """A sampling_params_list entry's stop_token_ids are answered before the thinker runs by the codes the
    talker stage's live replicas stop at (replica_limits: codec_stops), not by config.json's keys; where
    one registered none, or none is live, the talker checks."""
    def rep(stage_id, rid, stops=None):
        return msgspec.structs.replace(replica(stage_id, rid),
                                       capabilities=replica_limits(types.SimpleNamespace(codec_stops=stops)))
    fe = frontend()
    topo = Topology()
    follow_limits(fe, topo, PIPELINE)
    topo.apply(TopologyEvent("SNAPSHOT", [rep(0, "thinker"), rep(1, "a", {8292, 8293})], 1))
    assert fe.stage_codec_stops == {1: {8292, 8293}}
    topo.apply(TopologyEvent("ADDED", [rep(1, "b", {8292})], 2))
    assert fe.stage_codec_stops == {1: {8292}}       # any may be picked: the codes every one takes
    topo.apply(TopologyEvent("ADDED", [rep(1, "c")], 3))
    assert fe.stage_codec_stops == {}
    topo.apply(TopologyEvent("REMOVED", [rep(1, "c"), rep(1, "b")], 4))
    assert fe.stage_codec_stops == {1: {8292, 8293}}
    topo.apply(TopologyEvent("REMOVED", [rep(1, "a")], 5))
    assert fe.stage_codec_stops == {}
