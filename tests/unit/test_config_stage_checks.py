"""A stage's `devices`, `connectors` and `engine_args` do what they say, or the deploy is refused at
load naming the key (omni/config_stage_checks.py); every shipped deploy still loads."""

import json
import os

import pytest
import yaml

from omni import config as cfg
from omni.cli import main
from omni.config_stage_checks import SERVING_ONLY_ARGS
from omni.errors import ConfigError
from omni.stage.main import select_devices
from omni.transport.factory import auto_transport
from tests.unit import test_config_vllm_omni as vo_tests

THREE = """model: m
stages:
  - {stage_id: 0, engine: vllm, inputs: [prompt], final_output: true, final_output_type: text}
  - {stage_id: 1, engine: piper_talker, inputs: [0]}
  - {stage_id: 2, engine: piper_code2wav, inputs: [1], final_output: true, final_output_type: audio}
"""


def load(tmp_path, text, name="d.yaml", model="m", **kw):
    path = tmp_path / name
    path.write_text(text)
    return cfg.load(model, str(path), **kw)


def stage0(field: str) -> str:
    return ("model: m\nstages: [{stage_id: 0, engine: vllm, final_output: true, final_output_type: text, "
            + field + "}]\n")


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("devices, expected", [
    ('"0"', "0"), ('"0,1"', "0,1"), ("1", "1"), ('" 2, 3 "', "2,3"), ('"0,"', "0"),
    ('"cuda:0"', "0"), ('"cuda:0,cuda:1"', "0,1"), ('"CUDA:3"', "3"), ("cpu", "cpu"), ("CPU", "cpu"),
    ("null", ""), ("~", ""), ('""', ""),    # vllm-omni's `devices: str | None = None`: the visible GPUs, unrestricted
])
def test_devices_take_vllm_omnis_forms(tmp_path, devices, expected):
    """"cuda:0" was CUDA_VISIBLE_DEVICES=cuda:0 (no GPU at all); a YAML integer was a type error."""
    assert load(tmp_path, stage0(f"devices: {devices}")).stages[0].devices == expected


@pytest.mark.parametrize("devices, message", [
    ('"-1"', "'-1' in '-1' is not a GPU index (a non-negative integer)"),
    ("-1", "'-1' in -1 is not a GPU index"),
    ('"0.5"', "'0.5' in '0.5' is not a GPU index"),
    ('"gpu0"', "'gpu0' in 'gpu0' is not a GPU index"),
    ('"cuda:x"', "'cuda:x' in 'cuda:x' is not a GPU index"),
    ('"cuda"', "'cuda' in 'cuda' is not a GPU index"),
    ('"0;1"', "'0;1' in '0;1' is not a GPU index"),
    ('"0,cuda:0"', "'0,cuda:0' names GPU 0 twice"),
    ('","', "devices must be 'cpu' or GPU indices"),
    ("[0, 1]", "devices must be 'cpu' or GPU indices into the visible GPUs: \"0\", \"0,1\" (or \"cuda:0,cuda:1\"), "
               "got [0, 1]"),
    ("true", "devices must be 'cpu' or GPU indices"),
])
def test_bad_devices_are_refused_at_load_naming_the_key(tmp_path, devices, message):
    with pytest.raises(ConfigError, match=r"d\.yaml: stages\[0\]\.devices") as e:
        load(tmp_path, stage0(f"devices: {devices}"))
    assert message in str(e.value)


def test_devices_are_normalised_wherever_they_are_set(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    text = THREE + "platforms: {cuda: {stages: [{stage_id: 1, devices: 'cuda:1'}]}}\n"
    c = load(tmp_path, text, stage_overrides={"2": {"devices": "cuda:0,cuda:2"}})
    assert [s.devices for s in c.stages] == ["cpu", "1", "0,2"]
    assert cfg.loads_json(json.dumps(c.to_dict())).config_hash() == c.config_hash()
    # vllm-omni's legacy stage config: runtime.devices
    legacy = load(tmp_path, vo_tests.LEGACY_QWEN25.replace('devices: "1"', 'devices: "cuda:1"'), "legacy.yaml",
                  vo_tests.QWEN25)
    assert [s.devices for s in legacy.stages] == ["0", "1", "1"]
    with pytest.raises(ConfigError, match=r"^--stage-overrides: stages\[1\]\.devices: 'gpu1' in 'gpu1' is not"):
        load(tmp_path, THREE, "overrides.yaml", stage_overrides={"1": {"devices": "gpu1"}})


@pytest.mark.parametrize("overrides, message", [
    ({"0": {"default_sampling_params": {"max_tokns": 3}}},
     "--stage-overrides: stages[0].default_sampling_params.max_tokns: unknown field"),
    ({"2": {"default_sampling_params": {"max_tokens": "x"}}},
     "--stage-overrides: stages[2].default_sampling_params.max_tokens: Expected `int | null`, got `str`"),
    ({"0": {"final_output": "yes"}}, "--stage-overrides: stages[0].final_output: Expected `bool`, got `str`"),
])
def test_a_refused_stage_override_names_the_flag_not_the_yaml(tmp_path, overrides, message):
    """It blamed the deploy YAML it patched: "omni/deploy/smollm2-135m-instruct.yaml: Object contains unknown
    field `max_tokns` - at `stages[0].default_sampling_params`"."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, THREE, stage_overrides=overrides)
    assert str(e.value) == message


def test_the_yamls_own_error_still_names_the_yaml_under_stage_overrides(tmp_path):
    text = THREE.replace("engine: piper_talker,", "engine: piper_talker, final_output: maybe,")
    with pytest.raises(ConfigError, match=r"d\.yaml: Expected `bool`, got `str` - at `stages\[1\]\.final_output`"):
        load(tmp_path, text, stage_overrides={"0": {"default_sampling_params": {"max_tokens": 3}}})


def test_devices_null_over_a_base_leaves_the_visible_gpus_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    (tmp_path / "base.yaml").write_text(THREE.replace("inputs: [0]}", "inputs: [0], devices: '1'}"))
    c = load(tmp_path, "base_config: base.yaml\nstages: [{stage_id: 1, devices: null}]\n")
    assert c.stages[1].devices == ""
    # vllm-omni's legacy runtime.devices too
    legacy = load(tmp_path, vo_tests.LEGACY_QWEN25.replace('devices: "1"}', "devices: null}"), "legacy.yaml",
                  vo_tests.QWEN25)
    assert [s.devices for s in legacy.stages] == ["0", "1", ""]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    select_devices(c.stages[1].devices)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_normalised_devices_reach_cuda_visible_devices_and_the_transport_choice(tmp_path, monkeypatch):
    c = load(tmp_path, THREE.replace("inputs: [0]}", "inputs: [0], devices: 'cuda:2,cuda:3'}")
             .replace("inputs: [1],", "inputs: [1], devices: 'cuda:3',"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    select_devices(c.stages[1].devices)              # indices into the outer selection
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    # the talker's cuda:1 is GPU 3, which code2wav sees: CUDA IPC
    assert auto_transport(True, "cuda:1", c.stages[1].devices, c.stages[2].devices, {"cuda_ipc"}) == "cuda_ipc"
    assert auto_transport(True, "cuda:0", c.stages[1].devices, c.stages[2].devices, {"cuda_ipc"}) == "shm"


# ---------------------------------------------------------------- connectors


@pytest.mark.parametrize("stage, edge, why", [
    (1, "1", "a stage has no edge to itself"),
    (1, "0", "stage 0 comes before stage 1 (edges run to later stages)"),
    (0, "2", "stage 2 does not read stage 0's output (its inputs: [1])"),
])
def test_a_connector_off_the_pipelines_edges_is_refused(tmp_path, stage, edge, why):
    """Each was accepted and did nothing: the orchestrator looks up only the consumer's key."""
    text = THREE.replace(f"{{stage_id: {stage}, ", f"{{stage_id: {stage}, connectors: {{'{edge}': {{transport: tcp}}}}, ")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert str(e.value) == (
        f"{tmp_path / 'd.yaml'}: stages[{stage}].connectors.{edge}: not an edge of the pipeline: {why}; a connector "
        f"is keyed by a stage whose inputs name this one ('{stage + 1}'); the pipeline's edges: 0->1, 1->2")


def test_a_connector_on_an_edge_is_taken(tmp_path):
    c = load(tmp_path, THREE.replace("{stage_id: 1, ", "{stage_id: 1, connectors: {'2': {transport: tcp}}, "))
    assert c.stages[1].connectors["2"].transport == "tcp"


def test_a_vllm_omni_connector_off_the_edges_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    text = vo_tests.VLLM_OMNI_QWEN3.replace("input_connectors: {from_stage_1: shm_link}",
                                            "input_connectors: {from_stage_0: shm_link}")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.connectors\.2: not an edge of the pipeline: stage 2 does "
                                          r"not read stage 0's output .* the pipeline's edges: 0->1, 1->2"):
        load(tmp_path, text, model=vo_tests.QWEN3)


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_every_shipped_deploy_loads(monkeypatch, tmp_path, platform):
    """omni's bundled deploys, and vllm-omni's (its deploy schema and its legacy stage configs) over them."""
    monkeypatch.setenv("OMNI_PLATFORM", platform)
    paths = sorted(cfg.DEPLOY_DIR.glob("*.yaml"))
    assert len(paths) >= 12
    for path in paths:
        model = yaml.safe_load(path.read_text()).get("model")
        c = cfg.load("m" if model in (None, "local") else model, str(path))
        assert all(s.devices == "cpu" or s.devices.replace(",", "").isdigit() for s in c.stages), path.name
    for model, text in ((vo_tests.QWEN3, vo_tests.VLLM_OMNI_QWEN3), (vo_tests.QWEN25, vo_tests.VLLM_OMNI_QWEN25),
                        (vo_tests.QWEN25, vo_tests.LEGACY_QWEN25)):
        load(tmp_path, text, model=model)
    for model in (vo_tests.QWEN3, vo_tests.QWEN25, "smollm2"):
        c = cfg.load(model)
        assert [(s.stage_id, list(s.connectors)) for s in c.stages if s.connectors] == [(1, ["2"])]


# ---------------------------------------------------------------- engine args


@pytest.mark.parametrize("key", [*SERVING_ONLY_ARGS, "served_model_name"])
def test_engine_args_only_vllms_server_reads_are_refused_by_name(tmp_path, key):
    """vLLM took them and changed nothing: the frontend tokenizes with MODEL's tokenizer, samples with the
    deploy's defaults and names the model by --served-model-name; a revision of a folder is the folder."""
    with pytest.raises(ConfigError, match=rf"d\.yaml: stages\[0\]\.engine_args\.{key}: not supported: "):
        load(tmp_path, stage0(f"engine_args: {{{key}: x}}"))
    # vllm-omni's flat form, and --stage-overrides
    with pytest.raises(ConfigError, match=rf"stages\[0\]\.engine_args\.{key}: not supported: "):
        load(tmp_path, stage0(f"{key}: x"))
    with pytest.raises(ConfigError, match=rf"stages\[0\]\.engine_args\.{key}: not supported: "):
        load(tmp_path, stage0("engine_args: {}"), stage_overrides={"0": {key: "x"}})
    # a headless stage's own engine flags (--engine-args)
    config = load(tmp_path, stage0("engine_args: {}"))
    with pytest.raises(ConfigError, match=rf"stage 0's engine flags: {key}: not supported: "):
        cfg.apply_engine_flags(config, 0, {key: "x"})


def test_a_profiler_config_is_refused_as_it_could_never_start(tmp_path):
    """vllm-omni's profiling form: vLLM's stage took it, and only vLLM's POST /start_profile starts it."""
    prof = "{profiler: torch, torch_profiler_dir: /tmp/p}"
    with pytest.raises(ConfigError, match=r"engine_args\.profiler_config: not supported: omni has no /start_profile"):
        load(tmp_path, stage0(f"engine_args: {{max_model_len: 64, profiler_config: {prof}}}"))
    with pytest.raises(ConfigError, match=r"engine_args\.profiler_config: not supported: "):
        load(tmp_path, stage0("engine_args: {}"), stage_overrides={"0": {"profiler_config": {"profiler": "torch"}}})


def test_engine_args_vllm_acts_on_still_pass(tmp_path):
    c = load(tmp_path, stage0("engine_args: {hf_config_path: /cfg, tokenizer_mode: hf, max_model_len: 64}"))
    assert c.stages[0].engine_args["hf_config_path"] == "/cfg"


@pytest.mark.parametrize("flag, why", [
    ("--code-revision", "loads MODEL as it is on disk"),
    ("--override-generation-config", "default_sampling_params in the deploy YAML"),
    ("--tokenizer-revision", "loads MODEL as it is on disk"),
    # they were put into the thinker's engine args, and file:// and http URLs stayed 400s
    ("--allowed-media-domains", "omni fetches no URL: send input_audio or data: URLs"),
    ("--allowed-local-media-path", "omni fetches no URL: send input_audio or data: URLs"),
    ("--media-io-kwargs", "takes no media loading arguments"),
    ("--interleave-mm-strings", "where it stands in the message"),
])
def test_the_flag_form_is_refused_with_the_same_reason(capsys, flag, why):
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", flag, "x", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"omni: error: {flag}: vLLM's serve option, not supported: " in err and why in err, err


@pytest.mark.parametrize("model", ["smollm2", vo_tests.QWEN3])
def test_enable_mm_embeds_is_refused_by_name(capsys, model):
    """It went into the thinker's engine args (vLLM then keeps encoder room for image and video embeddings),
    while omni's chat answers every image_embeds / audio_embeds part with a 400."""
    with pytest.raises(SystemExit) as e:
        main(["serve", model, "--enable-mm-embeds", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "omni: error: --enable-mm-embeds: vLLM's serve option, not supported: omni's chat takes no image_embeds" \
        in err, err


# ---------------------------------------------------------------- limit_mm_per_prompt


@pytest.mark.parametrize("limits, message", [
    ('{"image": 1}', "limit_mm_per_prompt.image: 1 is not supported: omni takes no image input"),
    ('{"video": {"count": 2}}', "limit_mm_per_prompt.video: 2 is not supported: omni takes no video input"),
    ('{"image": {"width": 64}}', "limit_mm_per_prompt.image: 999 is not supported"),   # vLLM's count when unset
    ('{"audio": -1}', "limit_mm_per_prompt.audio must be a count >= 0"),
    ('3', "limit_mm_per_prompt must be a mapping of modality -> count"),
])
def test_mm_limits_omni_cannot_serve_are_refused_at_load(tmp_path, capsys, limits, message):
    """{"image": 1} passed --dry-run, and every image_url part was still a 400."""
    with pytest.raises(ConfigError, match=rf"d\.yaml: stages\[0\]\.engine_args\.{message}"):
        load(tmp_path, stage0(f"engine_args: {{limit_mm_per_prompt: {limits}}}"))
    with pytest.raises(ConfigError, match=rf"^--stage-overrides: stages\[0\]\.engine_args\.{message}"):
        load(tmp_path, stage0("engine_args: {}"), stage_overrides={"0": {"limit_mm_per_prompt": json.loads(limits)}})
    tail = message.removeprefix("limit_mm_per_prompt")
    for flags, named in ((["--limit-mm-per-prompt", limits], "--limit-mm-per-prompt"),
                         (["--engine-args", f'{{"limit_mm_per_prompt": {limits}}}'], "--engine-args limit_mm_per_prompt")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "smollm2", *flags, "--dry-run"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"omni: error: {named}{tail}" in err, err


def test_mm_limits_vllm_takes_pass(tmp_path):
    c = load(tmp_path, stage0('engine_args: {limit_mm_per_prompt: {audio: {count: 2, length: 16000}, image: 0}}'))
    assert c.stages[0].engine_args["limit_mm_per_prompt"]["audio"] == {"count": 2, "length": 16000}
