import json

import pytest

from omni import config as cfg
from omni.cli import fold_dotted_args
from omni.errors import ConfigError

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BASE = "model: m\nstages: [{stage_id: 0, engine: torch_lm, final_output: true, final_output_type: text}]\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_bundled_default_by_model_id_and_alias():
    a = cfg.load(MODEL)
    b = cfg.load("smollm2-135m-instruct")
    assert [s.name for s in a.stages] == ["thinker", "talker", "code2wav"]
    assert a.stages[0].engine == "torch_lm" and a.final_stage("audio").stage_id == 2
    assert a.config_hash() != b.config_hash()   # the model name is part of the pipeline
    assert cfg.load(MODEL).config_hash() == a.config_hash()


def test_unknown_model_names_the_flag():
    with pytest.raises(ConfigError, match="--deploy-config"):
        cfg.load("no/such-model")


def test_stage_overrides_patch_fields_and_engine_args():
    c = cfg.load(MODEL, stage_overrides={"0": {"max_model_len": 512, "engine": "vllm"}, "2": {"num_replicas": 2}})
    assert c.stages[0].engine == "vllm"
    assert c.stages[0].engine_args["max_model_len"] == 512
    assert c.stages[0].engine_args["dtype"] == "bfloat16"   # untouched keys stay
    assert c.stages[2].num_replicas == 2
    assert c.config_hash() != cfg.load(MODEL).config_hash()


@pytest.mark.parametrize("overrides, match", [
    ({"9": {}}, "unknown stage 9"),
    ({"x": {}}, "not a stage id"),
    ({"0": 3}, "expected an object"),
    ({"0": {"stage_id": 4}}, "stage_id cannot"),
])
def test_bad_stage_overrides(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg.load(MODEL, stage_overrides=overrides)


def test_base_config_inheritance_merges_stages_by_id(tmp_path):
    base = write(tmp_path, "base.yaml", """
model: m
stages:
  - {stage_id: 0, engine: torch_lm, engine_args: {dtype: float32, max_model_len: 256}, final_output: true, final_output_type: text}
  - {stage_id: 1, engine: hidden_pooler, inputs: [0], final_output: true, final_output_type: embedding}
""")
    child = write(tmp_path, "child.yaml", f"""
base_config: {base}
pipeline: {{name: child}}
stages:
  - {{stage_id: 0, engine_args: {{max_model_len: 128}}}}
""")
    c = cfg.load("m", child)
    assert c.pipeline.name == "child"
    assert c.stages[0].engine_args == {"dtype": "float32", "max_model_len": 128}
    assert c.stages[1].engine == "hidden_pooler"


@pytest.mark.parametrize("yaml_text, match", [
    # A flat stage key is an engine arg (vllm-omni's YAML shape): tests/unit/test_cli_compat.py.
    ("model: m\nstages: [{stage_id: 0, engine: torch_lm, final_output: true, final_output_type: text, "
     "engine_args: [1]}]", "Expected `object`, got `array` - at `stages\\[0\\].engine_args`"),
    ("model: m\nstages: [{stage_id: zero, engine: torch_lm}]", "`stages\\[0\\].stage_id` must be an integer, got 'zero'"),
    ("model: m\nstages: [{stage_id: 0, engine: a, final_output: true, final_output_type: text}, {stage_id: 2, engine: b}]",
     "contiguous"),
    ("model: m\nstages: [{stage_id: 0, engine: a, inputs: [1], final_output: true, final_output_type: text}]",
     "not an earlier stage"),
    ("model: m\nstages: [{stage_id: 0, engine: a, final_output: true, final_output_type: hologram}]", "final_output_type"),
    ("model: m\nstages: [{stage_id: 0, engine: a, connectors: {'1': {transport: pigeon}}}, "
     "{stage_id: 1, engine: b, inputs: [0], final_output: true, final_output_type: text}]",
     "stages\\[0\\].connectors.1.transport must be one of"),
    ("model: m\nstages: []", "empty"),
    ("model: m\nstages: [{stage_id: 0, engine: a, first_output_hold_ms: -1}, {stage_id: 1, engine: b, inputs: [0], "
     "final_output: true, final_output_type: audio}]",
     "stages\\[0\\].first_output_hold_ms must be in \\[0, 10000\\], got -1"),
    ("model: m\nstages: [{stage_id: 0, engine: a, final_output: true, final_output_type: text, "
     "first_output_hold_ms: 100}]", "first_output_hold_ms: only a stage whose output feeds a later stage"),
    ("model: m\nstages: [{stage_id: 0, engine: a}]", "final_output"),
    # A sampling key no engine reads is refused by name, never dropped (a typo would go unnoticed).
    ("model: m\nstages: [{stage_id: 0, engine: a, final_output: true, final_output_type: text, "
     "default_sampling_params: {temprature: 0.5}}]",
     "unknown field `temprature` - at `stages\\[0\\].default_sampling_params`"),
    ("model: m\nstages: [{stage_id: 0, engine: a, final_output: true, final_output_type: text, "
     "default_sampling_params: {max_tokens: many}}]",
     "got `str` - at `stages\\[0\\].default_sampling_params.max_tokens`"),
    ("- a list", "mapping"),
    ("model: [unclosed", "not valid YAML"),
    ("model: m\nplatforms: [cpu]\nstages: []", "`platforms` must be a mapping"),      # were tracebacks
    ("model: m\nstages: 5", "`stages` must be a list of stages, got int"),
    ("model: m\nstages: []\nplatforms: {cpu: {stages: {stage_id: 0}}}", "`platforms.cpu.stages` must be a list"),
    # Each of these was a traceback (a TypeError in the merge, or reading the file).
    ("base_config: 5", "base_config must be a deploy YAML's path, got 5"),
    ("base_config: [a]", "base_config must be a deploy YAML's path, got \\['a'\\]"),
    ("base_config: {tmp}", "{tmp}: cannot read the deploy config: Is a directory"),
    ("base_config: {tmp}/base.yaml\nstages: [{stage_id: '0', engine: x}]",
     "`stages\\[0\\].stage_id` must be an integer, got '0'"),
    ("base_config: {tmp}/base.yaml\nstages: [{stage_id: null, engine: x}]",
     "`stages\\[0\\].stage_id` must be an integer, got None"),
    (BASE + "platforms: {cpu: {stages: [{stage_id: '0'}]}}",
     "`platforms.cpu.stages\\[0\\].stage_id` must be an integer, got '0'"),
    # A stage that is no mapping was passed over by the merge: a platform's section over it dropped it, exit 0.
    ("base_config: {tmp}/base.yaml\nstages: [[stage_id: 2, engine: nosuch]]\nplatforms: {cpu: {stages: [{stage_id: 0}]}}",
     "`stages\\[0\\]` must be a mapping of a stage's keys, got list: \\[{'stage_id': 2}, {'engine': 'nosuch'}\\]"),
    ("base_config: {tmp}/base.yaml\nstages: [{stage_id: 0}, stage one]", "`stages\\[1\\]` must be a mapping"),
    (BASE + "platforms: {cuda: {stages: [null]}}", "`platforms.cuda.stages\\[0\\]` must be a mapping of a stage's keys, "
     "got NoneType"),
])
def test_bad_yaml_names_the_key(tmp_path, yaml_text, match):
    write(tmp_path, "base.yaml", BASE)
    path = write(tmp_path, "bad.yaml", yaml_text.replace("{tmp}", str(tmp_path)))
    with pytest.raises(ConfigError, match=match.replace("{tmp}", str(tmp_path))):
        cfg.load("m", path)


@pytest.mark.parametrize("make, match", [
    (lambda d: d, "cannot read the deploy config: Is a directory"),
    (lambda d: (d / "x.yaml").write_bytes(b"model: m\n\xff\xfe: 1\n") and d / "x.yaml", "not UTF-8 text"),
])
def test_an_unreadable_deploy_file_is_one_line_naming_it(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=f"{path}: {match}"):
        cfg.load("m", str(path))


def test_base_config_cycle(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text(f"base_config: {b}\n")
    b.write_text(f"base_config: {a}\n")
    with pytest.raises(ConfigError, match="cycle"):
        cfg.load("m", str(a))


def test_engine_flags_patch_one_stage_without_changing_the_hash():
    c = cfg.load(MODEL)
    patched = cfg.apply_engine_flags(c, 0, {"max_model_len": 64, "dtype": None})
    assert patched.stages[0].engine_args["max_model_len"] == 64
    assert patched.stages[1] == c.stages[1]
    assert c.config_hash() == cfg.load(MODEL).config_hash()


def test_resolved_config_round_trips_through_json():
    c = cfg.load(MODEL, stage_overrides={"1": {"num_replicas": 3}})
    assert cfg.loads_json(json.dumps(c.to_dict())).config_hash() == c.config_hash()


def test_dotted_json_flags_fold_into_one():
    argv = ["serve", "m", "--stage-overrides", '{"0": {"a": 1}}', "--stage-overrides.0.b", "2",
            "--stage-overrides.1.c=true", "--port", "0"]
    out = fold_dotted_args(argv)
    assert out[:4] == ["serve", "m", "--port", "0"]
    assert out[4] == "--stage-overrides"
    assert json.loads(out[5]) == {"0": {"a": 1, "b": 2}, "1": {"c": True}}


@pytest.mark.parametrize("argv, match", [
    (["--stage-overrides", "{nope"], "not valid JSON"),
    (["--stage-overrides", "[1]"], "expected a JSON object"),
    (["--stage-overrides.0..x", "1"], "empty key"),
    (["--stage-overrides"], "expected a value"),
])
def test_dotted_json_flag_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        fold_dotted_args(argv)


def test_backpressure_settings_are_checked():
    import pytest

    from omni.config import parse
    from omni.errors import ConfigError

    base = {"model": "m", "stages": [{"stage_id": 0, "engine": "torch_lm", "final_output": True,
                                      "final_output_type": "text"}]}
    assert parse(dict(base), source="x.yaml").pipeline.stall_timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"pipeline.stall_timeout_s must be > 0"):
        parse({**base, "pipeline": {"stall_timeout_s": 0}}, source="x.yaml")
    bad_arena = {"model": "m", "stages": [
        {"stage_id": 0, "engine": "torch_lm", "connectors": {"1": {"arena_bytes": 10}}},
        {"stage_id": 1, "engine": "pooler", "inputs": [0], "final_output": True, "final_output_type": "embedding"}]}
    with pytest.raises(ConfigError, match=r"stages\[0\].connectors.1.arena_bytes must be >= 4096"):
        parse(bad_arena, source="x.yaml")


def test_no_bundled_deploy_seeds_requests_by_default():
    """A deploy's default seed stands in for a client's missing one: Qwen2.5-Omni's (vllm-omni's 42) made every
    unseeded request's text and audio the same. As in vLLM and OpenAI's API, only a client's seed repeats."""
    from pathlib import Path

    import yaml

    for path in sorted((Path(cfg.__file__).parent / "deploy").glob("*.yaml")):
        for stage in yaml.safe_load(path.read_text()).get("stages") or []:
            assert "seed" not in (stage.get("default_sampling_params") or {}), (path.name, stage.get("name"))
