"""vllm-omni's per-stage `env`, `async_chunk` and `subtalker_sampling_params` do what they say in omni, or
the deploy is refused at load naming the key (they used to land in the stage's engine_args and fail the
stage after the processes had started)."""

import json
import os
import subprocess
import sys

import pytest

from omni import config as cfg
from omni.errors import ConfigError
from tests.e2e.harness import REPO

QWEN3 = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
QWEN25 = "Qwen/Qwen2.5-Omni-7B"
SUBTALKER = "subtalker_sampling_params"


@pytest.fixture(autouse=True)
def cuda_platform(monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")


def load(tmp_path, text, model=QWEN3, **kw):
    path = tmp_path / "overlay.yaml"
    path.write_text(text)
    return cfg.load(model, str(path), **kw)


def streams(config) -> list:
    return [s.engine_args.get("stream") for s in config.stages]


# ---------------------------------------------------------------- env


def test_the_reported_overlay_loads_each_key_where_it_acts(tmp_path):
    """The overlay that failed at start ("engine_args for 'qwen3_talker': unexpected keyword argument
    'env'"): env is the stage's, the subtalker's sampling the talker's engine arg, async_chunk off on the
    audio stage its whole decode."""
    c = load(tmp_path, "stages:\n  - {stage_id: 1, env: {FOO: '1', N: 2, X: 0.5}, "
                       f"{SUBTALKER}: {{temperature: 0.5}}}}\n  - {{stage_id: 2, async_chunk: false}}\n")
    talker = c.stages[1]
    assert talker.env == {"FOO": "1", "N": "2", "X": "0.5"}
    assert talker.engine_args[SUBTALKER] == {"temperature": 0.5}
    assert not {"env", "async_chunk"} & set(talker.engine_args)
    assert streams(c) == [None, None, False]
    assert c.stages[0].env == {} and cfg.loads_json(json.dumps(c.to_dict())) == c


def test_a_stages_runtime_section_is_read_as_its_own_keys(tmp_path):
    """vllm-omni's `runtime:` block on a deploy stage (devices, num_replicas, env, max_batch_size) sets
    the same keys as written on the stage, whose own win; an unknown runtime key is named."""
    c = load(tmp_path, "stages:\n  - stage_id: 1\n    max_num_seqs: 4\n    env: {FOO: own}\n    runtime:\n"
                       "      {devices: 0, num_replicas: 2, env: {FOO: rt, BAR: 2}, max_batch_size: 8}\n")
    talker = c.stages[1]
    assert (talker.devices, talker.num_replicas, talker.env) == ("0", 2, {"FOO": "own", "BAR": "2"})
    assert talker.engine_args["max_num_seqs"] == 4 and "runtime" not in talker.engine_args
    with pytest.raises(ConfigError, match=r"stages\[stage_id 1\]\.runtime\.gpus: 2 is not supported"):
        load(tmp_path, "stages:\n  - {stage_id: 1, runtime: {gpus: 2}}\n")


def test_env_merges_over_the_base_and_the_platform_section(tmp_path, monkeypatch):
    base = tmp_path / "base.yaml"
    base.write_text("stages:\n  - {stage_id: 1, env: {A: a, B: b}}\n")
    text = (f"base_config: {base}\nstages:\n  - {{stage_id: 1, env: {{B: B2}}}}\n"
            "platforms:\n  cuda:\n    stages:\n      - {stage_id: 1, env: {C: c}}\n")
    assert load(tmp_path, text).stages[1].env == {"A": "a", "B": "B2", "C": "c"}
    c = cfg.load(QWEN3, stage_overrides={"1": {"env": {"D": 4}}})
    assert c.stages[1].env == {"D": "4"}


@pytest.mark.parametrize("env, message", [
    ("{CUDA_VISIBLE_DEVICES: '0'}", "stages[1].env.CUDA_VISIBLE_DEVICES: not supported: omni sets it from the "
                                    "stage's `devices`"),
    ("{OMNI_TOKEN: x}", "stages[1].env.OMNI_TOKEN: not supported: it holds a secret"),
    ("{OMNI_API_KEYS: '[\"k\"]'}", "stages[1].env.OMNI_API_KEYS: not supported: it holds a secret"),
    ("{VLLM_API_KEY: k}", "stages[1].env.VLLM_API_KEY: not supported"),
    ("{OMNI_DIE_WITH_PARENT: '1'}", "stages[1].env.OMNI_DIE_WITH_PARENT: not supported"),
    ("{OMNI_PLATFORM: cpu}", "stages[1].env.OMNI_PLATFORM: not supported: it picks the deploy's platform section"),
    ("{OMNI_CACHE_DIR: /x}", "stages[1].env.OMNI_CACHE_DIR: not supported: it locates the models"),
    ("{A: true}", "stages[1].env.A must be text or a number, got bool (write the text the variable expects"),
    ("{A: null}", "stages[1].env.A must be text or a number, got null"),
    ("{A: {B: 1}}", "stages[1].env.A must be text or a number, got a mapping"),
    ("{A: [1]}", "stages[1].env.A must be text or a number, got a list"),
    ("{1: x}", "stages[1].env.1: not a variable name"),
    ("{'A=B': x}", "stages[1].env.A=B: not a variable name"),
    ("[A]", "stages[1].env must be a mapping of variable -> value, got list"),
    ("FOO=1", "stages[1].env must be a mapping of variable -> value, got str"),
])
def test_env_that_would_not_work_is_refused_at_load(tmp_path, env, message):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, f"stages:\n  - {{stage_id: 1, env: {env}}}\n")
    assert message in str(e.value)
    assert "secret-value" not in str(e.value)


def test_a_secret_value_is_never_echoed(tmp_path):
    from omni.config_stage_checks import RESERVED_ENV

    with pytest.raises(ConfigError) as e:
        load(tmp_path, "stages:\n  - {stage_id: 1, env: {OMNI_CONTROL_API_KEY: secret-value}}\n")
    assert "OMNI_CONTROL_API_KEY" in str(e.value) and "secret-value" not in str(e.value)
    assert set(RESERVED_ENV) >= {"OMNI_TOKEN", "OMNI_API_KEY", "OMNI_API_KEYS", "OMNI_CONTROL_API_KEY"}


STAGE_PROCESS = """
import json, multiprocessing, os, sys
from omni import proctree
from omni.config import loads_json
from omni.errors import OmniError
from omni.stage import main as stage_main

seen = {}
subreaper = proctree.become_subreaper

def first_thing_after_env():         # run_stage's first call once the env is set
    seen["at_start"] = [os.environ.get("FOO"), "torch" in sys.modules, "vllm" in sys.modules]
    from omni.engines import factory

    factory.build_engine = build_engine
    subreaper()

def child(q):
    q.put(os.environ.get("FOO"))

def build_engine(config, stage):     # where the engine would load: devices are set, a spawned child inherits
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    seen["at_build"] = [os.environ.get("FOO"), os.environ.get("CUDA_VISIBLE_DEVICES"), q.get(timeout=60)]
    p.join()
    raise OmniError("stop here")

if __name__ == "__main__":
    proctree.become_subreaper = first_thing_after_env
    from omni.stage import gpus

    gpus.visible_gpus = lambda: (1, None)   # the platform is cuda here (OMNI_PLATFORM): the pinned GPU is there
    config = loads_json(open(sys.argv[1]).read())
    rc = stage_main.run_stage(config, 1, stage_main.StageOptions(master_address="127.0.0.1:9"))
    print(json.dumps({"rc": rc, **seen}))
"""


def test_the_stage_process_sets_its_env_before_torch_and_its_devices(tmp_path, monkeypatch):
    """run_stage sets the stage's env first thing (the launcher's child has imported neither torch nor
    vLLM yet), then the stage's devices become CUDA_VISIBLE_DEVICES, and what the engine spawns inherits both."""
    c = load(tmp_path, "stages:\n  - {stage_id: 1, devices: '1', env: {FOO: bar}}\n")
    (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
    (tmp_path / "stage.py").write_text(STAGE_PROCESS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5", "PYTHONPATH": str(REPO)}
    env.pop("FOO", None)
    r = subprocess.run([sys.executable, str(tmp_path / "stage.py"), str(tmp_path / "config.json")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["rc"] == 1 and "stop here" in r.stderr
    assert seen["at_start"] == ["bar", False, False]
    assert seen["at_build"] == ["bar", "5", "bar"]


def test_the_launcher_starts_a_stage_with_its_env(tmp_path):
    from omni.launcher import Launcher, LaunchPlan

    c = load(tmp_path, "stages:\n  - {stage_id: 1, env: {FOO: bar}}\n")
    launcher = Launcher(LaunchPlan(c, stages=[0, 1, 2], api_server_count=0, token="t"))
    try:
        launcher._plan_children()
        envs = {ch.stage_id: ch.env for ch in launcher.children}
    finally:
        launcher.shutdown()
    assert envs[1]["FOO"] == "bar" and envs[1]["OMNI_TOKEN"] == "t"
    assert "FOO" not in envs[0] and "FOO" not in envs[2]


# ---------------------------------------------------------------- subtalker_sampling_params


def test_subtalker_sampling_params_is_the_qwen3_talkers_engine_arg(tmp_path):
    from omni.engines.factory import accepted_args

    assert SUBTALKER in accepted_args("qwen3_talker")         # the engine takes what the config leaves it
    c = load(tmp_path, f"stages:\n  - {{stage_id: 1, {SUBTALKER}: {{do_sample: true, temperature: 0.7, top_k: 32, "
                       "top_p: 0.95}}\n")
    assert c.stages[1].engine_args[SUBTALKER] == {"do_sample": True, "temperature": 0.7, "top_k": 32, "top_p": 0.95}
    # vllm-omni's engine_extras and --stage-overrides reach it too
    c = load(tmp_path, f"stages:\n  - {{stage_id: 1, engine_extras: {{{SUBTALKER}: {{top_k: 0}}}}}}\n")
    assert c.stages[1].engine_args[SUBTALKER] == {"top_k": 0}


@pytest.mark.parametrize("model, stage, value, message", [
    (QWEN3, 0, "{temperature: 0.5}", "stages[0].engine_args.subtalker_sampling_params: not supported by engine vllm"),
    (QWEN3, 2, "{temperature: 0.5}", "stages[2].engine_args.subtalker_sampling_params: not supported by engine "
                                     "qwen3_code2wav"),
    (QWEN25, 1, "{temperature: 0.5}", "not supported by engine qwen25_talker: it samples Qwen3-Omni's code predictor"),
    (QWEN3, 1, "{min_p: 0.1}", "stages[1].engine_args.subtalker_sampling_params.min_p: not supported (the code "
                               "predictor takes do_sample, temperature, top_k, top_p"),
    (QWEN3, 1, "{temperature: 2.5}", "subtalker_sampling_params.temperature must be in [0, 2], got 2.5"),
    (QWEN3, 1, "{temperature: x}", "subtalker_sampling_params.temperature must be in [0, 2], got 'x'"),
    (QWEN3, 1, "{top_k: 1.5}", "subtalker_sampling_params.top_k must be an integer -1, 0 (off) or positive"),
    (QWEN3, 1, "{top_p: 0}", "subtalker_sampling_params.top_p must be in (0, 1], got 0"),
    (QWEN3, 1, "{do_sample: 1}", "subtalker_sampling_params.do_sample must be true or false, got 1"),
    (QWEN3, 1, "0.5", "subtalker_sampling_params must be a mapping of do_sample / temperature / top_k / top_p"),
])
def test_subtalker_sampling_params_that_would_not_act_is_refused_at_load(tmp_path, model, stage, value, message):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, f"stages:\n  - {{stage_id: {stage}, {SUBTALKER}: {value}}}\n", model=model)
    assert message in str(e.value)


def test_the_engines_that_take_subtalker_sampling_params_are_the_ones_listed():
    from omni.config_stage_checks import SUBTALKER_ENGINES
    from omni.engines.factory import ENGINE_CLASSES, accepted_args

    takers = {name for name in ENGINE_CLASSES if SUBTALKER in (accepted_args(name) or ())}
    assert takers == set(SUBTALKER_ENGINES)


# ---------------------------------------------------------------- async_chunk per stage


@pytest.mark.parametrize("stages, expected", [
    ("[{stage_id: 2, async_chunk: false}]", [None, None, False]),      # the audio stage alone: its whole decode
    ("[{stage_id: 0, async_chunk: false}, {stage_id: 1, async_chunk: false}, {stage_id: 2, async_chunk: false}]",
     [None, None, False]),                                              # every stage: as pipeline-wide
    ("[{stage_id: 2, async_chunk: true}]", [None, None, None]),         # true changes nothing
    ("[{stage_id: 1, async_chunk: true}, {stage_id: 2, async_chunk: true}]", [None, None, None]),
])
def test_a_stages_own_async_chunk(tmp_path, stages, expected):
    c = load(tmp_path, f"stages: {stages}\n")
    assert streams(c) == expected
    assert not any("async_chunk" in s.engine_args for s in c.stages)    # no engine takes it


def test_a_stage_opts_in_only_where_the_pipeline_chunks(tmp_path):
    """vllm-omni: a stage chunks when the pipeline does and the stage does not opt out."""
    c = load(tmp_path, "async_chunk: false\nstages: [{stage_id: 1, async_chunk: true}, {stage_id: 2, async_chunk: true}]\n")
    assert streams(c) == [None, None, False]
    assert not any("async_chunk" in s.engine_args for s in c.stages)


@pytest.mark.parametrize("stages, message", [
    ("[{stage_id: 1, async_chunk: false}]", "stages[1].async_chunk: false, but its edge(s) 0 -> 1, 1 -> 2 stay "
                                            "chunked at the other end"),
    ("[{stage_id: 0, async_chunk: false}]", "stages[0].async_chunk: false, but its edge(s) 0 -> 1 stay chunked"),
    ("[{stage_id: 1, async_chunk: false}, {stage_id: 2, async_chunk: false}]", "stages[1].async_chunk: false, but "
                                                                               "its edge(s) 0 -> 1 stay chunked"),
    ("[{stage_id: 0, async_chunk: false}, {stage_id: 1, async_chunk: false}]", "stages[1].async_chunk: false, but "
                                                                               "its edge(s) 1 -> 2 stay chunked"),
])
def test_an_edge_chunked_at_one_end_is_refused_naming_the_stage(tmp_path, stages, message):
    """vllm-omni refuses these too (validate_stage_async_chunk_edges); only the audio stage may opt out alone."""
    with pytest.raises(ConfigError) as e:
        load(tmp_path, f"stages: {stages}\n")
    assert message in str(e.value)
    assert "set async_chunk: false on stage(s) " in str(e.value)


def test_the_cli_flag_wins_over_the_stages_own(tmp_path):
    assert streams(load(tmp_path, "stages: [{stage_id: 1, async_chunk: false}]\n", async_chunk=True)) == \
        [None, None, None]
    assert streams(load(tmp_path, "stages: [{stage_id: 2, async_chunk: true}]\n", async_chunk=False)) == \
        [None, None, False]
    # Qwen2.5's token2wav: its own whole decode too
    assert streams(load(tmp_path, "stages: [{stage_id: 2, async_chunk: false}]\n", model=QWEN25)) == \
        [None, None, False]


def test_a_stages_own_async_chunk_must_be_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\[stage_id 2\]\.async_chunk must be true or false, got 'no'"):
        load(tmp_path, "stages: [{stage_id: 2, async_chunk: 'no'}]\n")


def test_the_dry_run_shows_the_overlay_resolved(tmp_path):
    path = tmp_path / "overlay.yaml"
    path.write_text(f"stages: [{{stage_id: 1, env: {{FOO: hf_zq1}}, {SUBTALKER}: {{temperature: 0.5}}}}, "
                    "{stage_id: 2, async_chunk: false}]\n")
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", QWEN3, "--deploy-config", str(path), "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMNI_PLATFORM": "cpu"})
    assert r.returncode == 0, r.stderr
    stages = json.loads(r.stdout)["config"]["stages"]
    assert stages[1]["engine_args"][SUBTALKER] == {"temperature": 0.5}
    assert stages[1]["env"] == {"FOO": "***"} and "hf_zq1" not in r.stdout + r.stderr   # the keys, never the values
    assert stages[2]["engine_args"]["stream"] is False


# async_chunk as an engine arg (vllm-omni's OmniEngineArgs field): it reached the engine, which failed at start
# ("unexpected keyword argument 'async_chunk'"); it is the stage's own async_chunk wherever it is written.
LEGACY_QWEN3 = """
stage_args:
  - {stage_id: 0, engine_args: {model_stage: thinker}, final_output: true, final_output_type: text}
  - {stage_id: 1, engine_args: {model_stage: talker}, engine_input_source: [0]}
  - stage_id: 2
    engine_args: {model_stage: code2wav, async_chunk: false}
    engine_input_source: [1]
    final_output: true
    final_output_type: audio
"""


@pytest.mark.parametrize("kw", [
    {"text": "stages: [{stage_id: 2, engine_args: {async_chunk: false}}]\n"},
    {"text": "stages: [{stage_id: 2, engine_extras: {async_chunk: false}}]\n"},
    {"text": LEGACY_QWEN3},
    {"text": "stages: []\n", "stage_overrides": {"2": {"async_chunk": False}}},
    {"text": "stages: []\n", "stage_overrides": {"2": {"engine_args": {"async_chunk": False}}}},
    # the override wins over the YAML's own
    {"text": "stages: [{stage_id: 2, async_chunk: true}]\n", "stage_overrides": {"2": {"async_chunk": False}}},
])
def test_async_chunk_as_an_engine_arg_is_the_stages_own(tmp_path, kw):
    c = load(tmp_path, kw.pop("text"), **kw)
    assert streams(c) == [None, None, False]
    assert not any("async_chunk" in s.engine_args for s in c.stages)


def test_async_chunk_from_the_overrides_is_checked_as_the_stages_own(tmp_path):
    with pytest.raises(ConfigError, match=r"--stage-overrides: stages\[2\]\.async_chunk must be true or false"):
        load(tmp_path, "stages: []\n", stage_overrides={"2": {"async_chunk": "no"}})
    with pytest.raises(ConfigError, match=r"with --stage-overrides: stages\[1\]\.async_chunk: false, but its edge"):
        load(tmp_path, "stages: []\n", stage_overrides={"1": {"async_chunk": False}})
    # the last resort: an engine arg nothing lifted (a replica's engine flags) is refused by name
    with pytest.raises(ConfigError, match="async_chunk: not supported: it is the stage's own key"):
        cfg.apply_engine_flags(load(tmp_path, "stages: []\n"), 2, {"async_chunk": False})


def test_engine_args_async_chunk_on_the_command_line_is_the_flag():
    for extra in (["--engine-args", '{"async_chunk": false}'],
                  ["--stage-overrides", '{"2": {"async_chunk": false}}'],
                  ["--stage-id", "2", "--headless", "--omni-master-address", "127.0.0.1", "--omni-master-port", "9",
                   "--engine-args", '{"async_chunk": false}']):
        r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", QWEN3, *extra, "--dry-run"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, env={**os.environ, "OMNI_PLATFORM": "cuda"})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert [s["engine_args"].get("stream") for s in out["config"]["stages"]] == [None, None, False], extra
        assert "async_chunk" not in json.dumps(out["engine_flags"]) + json.dumps(out["config"])


# Started from PYTHONPATH: records FOO when torch is first imported, and stands in for run_stage.
SITECUSTOMIZE = """
import json, os, sys
seen = {"foo_at_start": os.environ.get("FOO")}
print("interpreter start", file=sys.stderr)

class TorchWatch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "foo_at_torch_import" not in seen:
            seen["foo_at_torch_import"] = os.environ.get("FOO")
        return None

sys.meta_path.insert(0, TorchWatch())
import omni.stage.main as stage_main

def run_stage(config, stage_id, opts, engine_flags=None):
    print(json.dumps({**seen, "torch_loaded": "torch" in sys.modules, "foo_at_run_stage": os.environ.get("FOO")}))
    return 0

stage_main.run_stage = run_stage
"""


def test_a_headless_stage_in_process_has_its_env_before_torch_loads(tmp_path):
    """`--headless` with one replica runs the stage in the CLI's own process, which has imported torch by then
    (loading the config with --no-async-chunk checks the engine's arguments): the env must be there from the
    interpreter's start, as the launcher's children have it, or LD_PRELOAD, OMP_*, TORCH_LOGS ... do nothing."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("stages:\n  - {stage_id: 2, env: {FOO: bar}}\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMNI_PLATFORM": "cuda"}
    env.pop("FOO", None)
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", QWEN3, "--deploy-config", str(overlay),
                        "--no-async-chunk", "--stage-id", "2", "--headless", "--omni-master-address", "127.0.0.1",
                        "--omni-master-port", "9"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["foo_at_torch_import"] == "bar" and seen["torch_loaded"]
    assert seen["foo_at_start"] == "bar" and seen["foo_at_run_stage"] == "bar"
    assert r.stderr.count("interpreter start") == 2     # started again (exec) with the env
    # the env already in place (a process started with it): no second start
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", QWEN3, "--deploy-config", str(overlay),
                        "--stage-id", "2", "--headless", "--omni-master-address", "127.0.0.1",
                        "--omni-master-port", "9"], cwd=REPO, env={**env, "FOO": "bar"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["foo_at_start"] == "bar"
    assert r.stderr.count("interpreter start") == 1


@pytest.mark.parametrize("overrides, message", [
    ({"1": {"env": {"OMNI_TOKEN": "zq"}}}, r"^--stage-overrides: stages\[1\]\.env\.OMNI_TOKEN: not supported"),
    ({"1": {"env": {"A": True}}}, r"^--stage-overrides: stages\[1\]\.env\.A must be text or a number"),
    ({"0": {SUBTALKER: {"temperature": 0.5}}},
     rf"^--stage-overrides: stages\[0\]\.engine_args\.{SUBTALKER}: not supported by engine"),
    ({"1": {"engine_args": {SUBTALKER: {"top_q": 1}}}},
     rf"^--stage-overrides: stages\[1\]\.engine_args\.{SUBTALKER}\.top_q: not supported"),
    ({"1": {"tokenizer": "x"}}, r"^--stage-overrides: stages\[1\]\.engine_args\.tokenizer: not supported"),
])
def test_a_refused_override_names_the_flag_not_the_yaml(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load(tmp_path, "stages: []\n", stage_overrides=overrides)
    assert "zq" not in str(e.value)
