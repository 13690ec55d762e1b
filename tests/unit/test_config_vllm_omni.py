"""vllm-omni's deploy YAML (its new schema: no engines, flat stage keys, connectors, pipeline-wide
keys) read by omni as an overlay on MODEL's bundled deploy."""

import json
import subprocess
import sys

import pytest
import yaml

from omni import config as cfg
from omni import config_vllm_omni as vo
from omni.errors import ConfigError
from tests.e2e.harness import REPO

QWEN3 = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
QWEN25 = "Qwen/Qwen2.5-Omni-7B"
# A deploy in vllm-omni's schema, shaped as its bundled qwen3_omni_moe deploy (values changed where a
# test must tell the file's value from the bundled one).
VLLM_OMNI_QWEN3 = """
async_chunk: true
trust_remote_code: true
connectors:
  shm_link:
    name: SharedMemoryConnector
    extra: {codec_chunk_frames: 20, codec_left_context_frames: 12}
stages:
  - stage_id: 0
    max_num_batched_tokens: 16384
    max_num_seqs: 32
    gpu_memory_utilization: 0.85
    enable_prefix_caching: false
    devices: "0"
    default_sampling_params: {temperature: 0.5, top_p: 0.9, top_k: 1, max_tokens: 1024, seed: 7}
  - stage_id: 1
    max_num_seqs: 16
    gpu_memory_utilization: 0.55
    devices: "1"
    input_connectors: {from_stage_0: shm_link}
    default_sampling_params: {temperature: 0.8, top_k: 40, max_tokens: 4096, repetition_penalty: 1.05}
  - stage_id: 2
    max_num_seqs: 16
    enforce_eager: true
    async_scheduling: false
    devices: "1"
    input_connectors: {from_stage_1: shm_link}
    engine_extras: {max_num_seqs: 99, max_frames: 200}
platforms:
  rocm:
    stages:
      - {stage_id: 0, enforce_eager: true}
"""


@pytest.fixture(autouse=True)
def cuda_platform(monkeypatch):
    """The file's values as written: the CUDA platform (the bundled deploy's `platforms.cpu` would
    resize the thinker on this box)."""
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")


def write(tmp_path, text, name="deploy.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_vllm_omni_deploy_overlays_the_models_bundled_pipeline(tmp_path):
    c = cfg.load(QWEN3, write(tmp_path, VLLM_OMNI_QWEN3))
    bundled = cfg.load(QWEN3)
    assert [(s.name, s.engine, s.processor, s.inputs) for s in c.stages] == \
        [(s.name, s.engine, s.processor, s.inputs) for s in bundled.stages]
    thinker, talker, code2wav = c.stages
    assert thinker.engine_args["max_num_batched_tokens"] == 16384 and thinker.engine_args["max_num_seqs"] == 32
    assert thinker.engine_args["gpu_memory_utilization"] == 0.85
    assert thinker.engine_args["emit_prompt_ids"] is True          # the bundled pipeline's own args stay
    assert thinker.default_sampling_params.set() == {"temperature": 0.5, "top_p": 0.9, "top_k": 1,
                                                     "max_tokens": 1024, "seed": 7}
    assert talker.default_sampling_params.top_k == 40 and talker.devices == "1"
    # pipeline-wide keys reach every stage; the rocm section is another platform's
    assert all(s.engine_args["trust_remote_code"] is True for s in c.stages)
    assert "enforce_eager" not in thinker.engine_args
    # the connector: the edges' transport, its codec keys on the stage that makes audio only
    assert thinker.connectors["1"].transport == "auto" and talker.connectors["2"].transport == "auto"
    assert (code2wav.engine_args["chunk_frames"], code2wav.engine_args["context_frames"]) == (20, 12)
    assert "chunk_frames" not in talker.engine_args
    # engine_extras: a key the stage sets itself wins
    assert code2wav.engine_args["max_num_seqs"] == 16 and code2wav.engine_args["max_frames"] == 200
    assert code2wav.engine_args["async_scheduling"] is False
    assert c.config_hash() != bundled.config_hash()


def test_vllm_omni_bundled_names_pick_omnis_pipelines(tmp_path):
    overlay = write(tmp_path, "base_config: /opt/vllm_omni/deploy/qwen3_omni_moe.yaml\n"
                              "stages:\n  - {stage_id: 1, gpu_memory_utilization: 0.5}\n")
    c = cfg.load(QWEN3, overlay)
    assert c.stages[1].engine_args["gpu_memory_utilization"] == 0.5
    assert c.stages[2].engine == "qwen3_code2wav"
    variant = cfg.load(QWEN3, write(tmp_path, "pipeline: qwen3_omni_moe_thinker_only\n", "variant.yaml"))
    assert [s.name for s in variant.stages] == [s.name for s in cfg.load(QWEN3, "qwen3-omni-moe-thinker-only").stages]


def test_omnis_own_deploys_pass_through_translation_unchanged():
    for path in sorted(cfg.DEPLOY_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        assert vo.translate(raw, str(path)) == raw, path.name


def test_a_dropped_key_is_named(tmp_path, capsys):
    cfg.load(QWEN3, write(tmp_path, "model_runner: v2\nstages:\n  - {stage_id: 1, model_runner: v1}\n"))
    err = capsys.readouterr().err
    assert "model_runner: 'v2' ignored" in err and "stage 1: model_runner: 'v1' ignored" in err


@pytest.mark.parametrize("text, message", [
    ("async_chunk: 'no'\n", "async_chunk must be true or false, got 'no'"),
    ("connectors:\n  m: {name: MooncakeStoreConnector, extra: {host: h}}\n", "connectors.m.name: 'MooncakeStoreConnector'"),
    ("connectors:\n  s: {name: SharedMemoryConnector, extra: {segment: 1}}\n", "connectors.s.extra.segment is not supported"),
    ("connectors:\n  s: {extra: {}}\n", "connectors.s: needs `name`"),
    ("stages:\n  - {stage_id: 1, input_connectors: {from_stage_0: nope}}\n", "no connector named 'nope'"),
    # a list or mapping where a name belongs was a TypeError traceback (unhashable)
    ("connectors:\n  s: {name: [SharedMemoryConnector]}\n",
     "connectors.s.name must be one connector class's name (SharedMemoryConnector), got ['SharedMemoryConnector']"),
    ("connectors:\n  s: {name: {a: 1}}\n", "connectors.s.name must be one connector class's name"),
    ("connectors:\n  s: {name: SharedMemoryConnector}\nstages:\n  - {stage_id: 1, input_connectors: {from_stage_0: [s]}}\n",
     "input_connectors.from_stage_0: no connector named ['s'] under `connectors` (defined: s)"),
    ("connectors:\n  s: {name: SharedMemoryConnector}\nstages:\n  - {stage_id: 0, output_connectors: {to_stage_1: {s: 1}}}\n",
     "output_connectors.to_stage_1: no connector named {'s': 1}"),
    ("connectors:\n  s: {name: SharedMemoryConnector}\nstages:\n  - {stage_id: 1, input_connectors: {stage0: s}}\n",
     "'stage0' must be from_stage_N"),
    ("edges: [[0, 1]]\n", "`edges` is not supported"),
    ("session_mode: duplex\n", "session_mode: 'duplex' is not supported"),
    ("distributed_executor_backend: ray\n", "'ray' is not supported: omni runs without Ray"),
    ("pipeline: bagel\n", "pipeline: 'bagel' is not a pipeline omni has"),
    ("pipeline: qwen3_omni_moe_thinker_only\nbase_config: x.yaml\n", "both pick the pipeline"),
    ("stages:\n  - {stage_id: 0, engine_extras: {devices: '3'}}\n", "engine_extras.devices: a stage field"),
    ("custom_voice_dir: /v\n", "`custom_voice_dir` is not supported"),
])
def test_what_omni_cannot_do_is_refused_by_name(tmp_path, text, message):
    with pytest.raises(ConfigError, match="deploy.yaml") as e:
        cfg.load(QWEN3, write(tmp_path, text))
    assert message in str(e.value)


def test_a_deploy_without_engines_needs_a_model_with_a_bundled_pipeline(tmp_path):
    with pytest.raises(ConfigError, match=r"vllm-omni's deploy schema\), so it overlays omni's bundled deploy for "
                                          r"the model, and omni has none for 'some/unknown-model' \(bundled: "):
        cfg.load("some/unknown-model", write(tmp_path, "stages:\n  - {stage_id: 0, max_num_seqs: 4}\n"))


def test_the_cli_serves_a_vllm_omni_deploy(tmp_path):
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", QWEN3, "--omni", "--deploy-config",
                        write(tmp_path, VLLM_OMNI_QWEN3), "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "OMNI_PLATFORM": "cuda"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["stages"][2]["engine_args"]["chunk_frames"] == 20


# vllm-omni's Qwen2.5-Omni deploy runs its stages end to end (async_chunk: false).
VLLM_OMNI_QWEN25 = """
async_chunk: false
stages:
  - {stage_id: 0, max_num_seqs: 1, enforce_eager: true, mm_processor_cache_gb: 0, devices: "0"}
  - {stage_id: 1, max_num_seqs: 1, devices: "1"}
  - {stage_id: 2, max_num_seqs: 1, enable_flashinfer_autotune: false, devices: "0"}
"""


def streams(config) -> list:
    return [s.engine_args.get("stream") for s in config.stages]


def test_async_chunk_false_decodes_each_utterance_whole(tmp_path):
    path = write(tmp_path, VLLM_OMNI_QWEN25)
    assert streams(cfg.load(QWEN25, path)) == [None, None, False]       # token2wav's whole decode
    assert streams(cfg.load(QWEN25, path, async_chunk=True)) == [None, None, None]
    assert streams(cfg.load(QWEN25)) == [None, None, None]              # omni's own deploy streams
    assert streams(cfg.load(QWEN25, async_chunk=False)) == [None, None, False]
    assert streams(cfg.load(QWEN3, async_chunk=False)) == [None, None, False]   # Qwen3's code2wav too


def test_no_async_chunk_on_the_cli(tmp_path):
    def dry_run(*args):
        return subprocess.run([sys.executable, "-m", "omni.cli", "serve", *args, "--dry-run"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    r = dry_run(QWEN25, "--no-async-chunk")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["stages"][2]["engine_args"]["stream"] is False
    r = dry_run("smollm2", "--no-async-chunk")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "stage 2's engine piper_code2wav has no whole-utterance decode" in r.stderr


# vllm-omni's legacy stage config (--stage-configs-path), shaped as its qwen2_5_omni stage config.
LEGACY_QWEN25 = """
stage_args:
  - stage_id: 0
    runtime: {devices: "0", max_batch_size: 2}
    engine_args:
      model_stage: thinker
      model_arch: Qwen2_5OmniForConditionalGeneration
      worker_cls: vllm_omni.worker.gpu_ar_worker.GPUARWorker
      gpu_memory_utilization: 0.7
      max_num_seqs: 3
      engine_output_type: latent
    is_comprehension: true
    final_output: true
    final_output_type: text
    default_sampling_params: {temperature: 0.0, max_tokens: 512, detokenize: true}
  - stage_id: 1
    runtime: {devices: "1", max_batch_size: 4}
    engine_args: {model_stage: talker, gpu_memory_utilization: 0.3}
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker
    default_sampling_params: {temperature: 0.9, top_k: 40, stop_token_ids: [8294]}
  - stage_id: 2
    runtime: {devices: "1"}
    engine_args: {model_stage: code2wav, engine_output_type: audio}
    engine_input_source: [1]
    final_output: true
    final_output_type: audio
"""


def test_a_legacy_stage_config_overlays_the_pipeline(tmp_path, capsys):
    c = cfg.load(QWEN25, write(tmp_path, LEGACY_QWEN25))
    thinker, talker, token2wav = c.stages
    assert [s.engine for s in c.stages] == [s.engine for s in cfg.load(QWEN25).stages]
    assert (thinker.devices, talker.devices, token2wav.devices) == ("0", "1", "1")
    assert thinker.engine_args["max_num_seqs"] == 3            # engine_args win over runtime.max_batch_size
    assert talker.engine_args["max_num_seqs"] == 4 and talker.engine_args["gpu_memory_utilization"] == 0.3
    assert thinker.engine_args["gpu_memory_utilization"] == 0.7 and "model_arch" not in thinker.engine_args
    assert thinker.default_sampling_params.set() == {"temperature": 0.0, "max_tokens": 512,
                                                     "top_p": 1.0, "top_k": 0,   # the bundled base sets no seed
                                                     "repetition_penalty": 1.1}
    assert talker.default_sampling_params.top_k == 40
    assert talker.default_sampling_params.stop_token_ids == (8294,)    # the talker checks it is its codec's end
    assert "detokenize, engine_output_type, is_comprehension, model_arch, worker_cls" in capsys.readouterr().err


def test_the_cli_takes_stage_configs_path(tmp_path):
    run = [sys.executable, "-m", "omni.cli", "serve", QWEN25, "--omni", "--stage-configs-path",
           write(tmp_path, LEGACY_QWEN25), "--dry-run"]
    r = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "OMNI_PLATFORM": "cuda"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["stages"][1]["engine_args"]["max_num_seqs"] == 4
    r = subprocess.run(run + ["--deploy-config", "x.yaml"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--deploy-config and --stage-configs-path both name the deploy" in r.stderr


@pytest.mark.parametrize("change, message", [
    (("model_stage: talker", "model_stage: thinker"), "model_stage: 'thinker', but stage 1 of omni's pipeline is 'talker'"),
    (("engine_input_source: [1]", "engine_input_source: [0]"), "engine_input_source: [0], but omni's token2wav takes [1]"),
    (("    final_output_type: audio\n", ""), "final_output True None, but omni's token2wav has True 'audio'"),
    (("vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker", "my_pkg.convert"),
     "custom_process_input_func: 'my_pkg.convert' is not supported"),
    (('runtime: {devices: "1"}', "runtime: {devices: '1', process: false}"), "runtime.process: False is not supported"),
    (("is_comprehension: true", "is_comprehension: true\n    placement: x"), "stage_args[stage_id 0]: unknown key 'placement'"),
])
def test_a_legacy_stage_config_that_is_not_omnis_pipeline_is_refused(tmp_path, change, message):
    text = LEGACY_QWEN25.replace(*change)
    assert text != LEGACY_QWEN25
    with pytest.raises(ConfigError) as e:
        cfg.load(QWEN25, write(tmp_path, text))
    assert message in str(e.value)


# vllm-omni's qwen2_5_omni.yaml (stage_configs, 2dfcb18) ends with this block.
LEGACY_RUNTIME = """
runtime:
  enabled: true
  defaults: {window_size: -1, max_inflight: 1}
  edges:
    - {from: 0, to: 1, window_size: -1}
    - {from: 1, to: 2, window_size: -1}
"""


def test_a_legacy_stage_configs_runtime_block_is_read(tmp_path, capsys):
    """The file was refused: "unknown top-level key(s) runtime in a stage config". max_inflight (requests a stage
    holds at once) is max_num_seqs where a stage sets none; window_size -1 and enabled are named and dropped."""
    c = cfg.load(QWEN25, write(tmp_path, LEGACY_QWEN25 + LEGACY_RUNTIME))
    assert [s.engine_args["max_num_seqs"] for s in c.stages] == [3, 4, 1]    # the stages' own win
    assert "runtime: enabled, window_size -1 (omni hands each stage's output on as it comes" in \
        capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (("window_size: -1, ", "window_size: 8, "), "runtime.defaults.window_size: 8 is not supported"),
    (("- {from: 1, to: 2, window_size: -1}", "- {from: 1, to: 2, window_size: 4}"),
     "runtime.edges[1].window_size: 4 is not supported"),
    (("from: 1, to: 2", "from: 0, to: 2"), "runtime.edges[1]: 0 -> 2 is not an edge of stage_args"),
    (("max_inflight: 1", "max_inflight: 0"), "runtime.defaults.max_inflight must be an integer >= 1, got 0"),
    (("enabled: true", "enabled: yes-please"), "runtime.enabled must be true or false"),
    (("enabled: true", "enabled: true\n  placement: x"), "runtime: unknown key(s) placement"),
    (("max_inflight: 1}", "max_inflight: 1, batch_timeout: 10}"), "runtime.defaults: unknown key(s) batch_timeout"),
])
def test_a_legacy_runtime_value_omni_cannot_honour_is_refused_by_name(tmp_path, change, message):
    text = LEGACY_RUNTIME.replace(*change)
    assert text != LEGACY_RUNTIME
    with pytest.raises(ConfigError) as e:
        cfg.load(QWEN25, write(tmp_path, LEGACY_QWEN25 + text))
    assert message in str(e.value)


def test_a_legacy_stage_config_lists_every_stage(tmp_path):
    text = LEGACY_QWEN25.split("  - stage_id: 1")[0]
    with pytest.raises(ConfigError, match=r"stage_args lists stages \[0\]; omni's pipeline for this model has "
                                          r"0 thinker, 1 talker, 2 token2wav"):
        cfg.load(QWEN25, write(tmp_path, text))


@pytest.mark.parametrize("key, value", [("codec_left_context_frames", 0), ("codec_chunk_frames", 0),
                                        ("codec_left_context_frames", "25"), ("codec_left_context_frames", True)])
def test_a_connectors_codec_frames_below_one_are_refused_by_its_key(tmp_path, key, value):
    """codec_left_context_frames: 0 (valid in vllm-omni) made omni's code2wav emit only each chunk's last 555
    samples; it is refused at load, naming the key as written."""
    text = VLLM_OMNI_QWEN3.replace(f"{key}: {12 if 'context' in key else 20}", f"{key}: {json.dumps(value)}")
    with pytest.raises(ConfigError, match=rf"connectors\.shm_link\.extra\.{key} must be a number of frames >= 1, "
                                          rf"got {value!r}"):
        cfg.load(QWEN3, write(tmp_path, text))


@pytest.mark.parametrize("key", ["context_frames", "chunk_frames", "first_chunk_frames"])
def test_code2wav_frame_args_below_one_are_refused_at_load(tmp_path, key):
    text = VLLM_OMNI_QWEN3.replace("max_frames: 200}", f"max_frames: 200, {key}: 0}}")
    with pytest.raises(ConfigError, match=rf"stages\[2\]\.engine_args\.{key} must be a number of frames >= 1, got 0"):
        cfg.load(QWEN3, write(tmp_path, text))


@pytest.mark.parametrize("key, value, shown", [("data_parallel_size", 0, "0"), ("max_num_batched_tokens", "0k", "0"),
                                               ("num_threads", "2", "'2'"), ("tensor_parallel_size", True, "True")])
def test_engine_counts_below_one_are_refused_at_load_naming_the_key(tmp_path, key, value, shown):
    text = VLLM_OMNI_QWEN3.replace("max_frames: 200}", f"max_frames: 200, {key}: {json.dumps(value)}}}")
    with pytest.raises(ConfigError, match=rf"stages\[2\]\.engine_args\.{key} must be an integer >= 1, got {shown}$"):
        cfg.load(QWEN3, write(tmp_path, text))
