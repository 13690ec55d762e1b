"""Deploy numbers out of range are refused by key, NaN and inf included."""

import pytest

from omni import config as cfg
from omni.config_checks import PIPELINE_SECONDS
from omni.errors import ConfigError

STAGES = "stages: [{stage_id: 0, engine: torch_lm, final_output: true, final_output_type: text}]\n"


def load(tmp_path, text):
    path = tmp_path / "d.yaml"
    path.write_text("model: m\n" + text)
    return cfg.load("m", str(path))


@pytest.mark.parametrize("key", PIPELINE_SECONDS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "0"])
def test_pipeline_seconds_must_be_finite_and_positive(tmp_path, key, value):
    """A NaN request timeout failed every request at once; a NaN lease never expired a dead replica."""
    with pytest.raises(ConfigError, match=rf"pipeline\.{key} must be > 0 and finite \(seconds\), got"):
        load(tmp_path, f"pipeline: {{{key}: {value}}}\n" + STAGES)


@pytest.mark.parametrize("pipeline, match", [
    ("max_tokens_limit: 0", r"pipeline\.max_tokens_limit must be >= 1 \(or unset: the context\), got 0"),
    ("max_speech_chars: 0", r"pipeline\.max_speech_chars must be in \[1, 4096\], got 0"),
    ("max_speech_chars: 5000", r"pipeline\.max_speech_chars must be in \[1, 4096\], got 5000"),
])
def test_pipeline_sizes_are_range_checked(tmp_path, pipeline, match):
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, f"pipeline: {{{pipeline}}}\n" + STAGES)


@pytest.mark.parametrize("key, value, wanted", [
    ("max_tokens", "0", ">= 1"), ("max_tokens", "-5", ">= 1"),
    ("top_p", ".nan", r"in \(0, 1\]"), ("top_p", "0", r"in \(0, 1\]"), ("top_p", "1.5", r"in \(0, 1\]"),
    ("repetition_penalty", "0", r"in \(0, 2\]"), ("repetition_penalty", "-1", r"in \(0, 2\]"),
    ("temperature", "-0.1", r"in \[0, 2\]"), ("temperature", ".nan", r"in \[0, 2\]"),
    ("temperature", ".inf", r"in \[0, 2\]"), ("presence_penalty", "3", r"in \[-2, 2\]"),
    ("top_k", "-2", "-1, 0 \\(off\\) or positive"), ("min_tokens", "-1", ">= 0"),
    ("stop_token_ids", "[-1]", r"token ids in \[0, 2\*\*63\)"),
    ("stop_token_ids", f"[5, {2**64}]", r"token ids in \[0, 2\*\*63\)"),   # failed only when sent to the stage
    ("stop_token_ids", f"[{2**63}]", r"token ids in \[0, 2\*\*63\)"),
    # past int64 a stage's message cannot carry it
    ("max_tokens", str(2**64), r">= 1 \(and below 2\*\*63\)"), ("seed", str(2**63), "a 64-bit signed integer"),
    ("top_k", str(2**63), r"-1, 0 \(off\) or positive \(below 2\*\*63\)"),
    ("min_tokens", str(2**63), r">= 0 \(and below 2\*\*63\)"),
])
def test_stage_sampling_defaults_get_the_apis_ranges(tmp_path, key, value, wanted):
    stages = STAGES.replace("final_output: true", f"default_sampling_params: {{{key}: {value}}}, final_output: true")
    with pytest.raises(ConfigError, match=rf"stages\[0\]\.default_sampling_params\.{key} must be {wanted}"):
        load(tmp_path, stages)



@pytest.mark.parametrize("engine, refused", [("qwen3_talker", True), ("qwen25_talker", True), ("torch_lm", False),
                                             (None, False)])
def test_a_talkers_presence_and_frequency_penalties_are_refused_by_key(engine, refused):
    """A Qwen-Omni talker has no presence/frequency penalty: its default_sampling_params naming one (not 0) is
    refused naming the key, as the talker refuses it; other stages keep the range check alone."""
    from omni.config_checks import check_sampling
    from omni.sampling import SamplingOverrides

    for key in ("presence_penalty", "frequency_penalty"):
        check_sampling(SamplingOverrides(**{key: 0.0}), "stages[1]", engine)
        if refused:
            with pytest.raises(ConfigError, match=rf"stages\[1\]\.default_sampling_params\.{key} is not supported by"):
                check_sampling(SamplingOverrides(**{key: 0.5}), "stages[1]", engine)
        else:
            check_sampling(SamplingOverrides(**{key: 0.5}), "stages[1]", engine)


def test_a_deploys_talker_penalty_is_refused_at_load_naming_the_yaml_key():
    """The refusal is applied when a deploy loads (--dry-run too), not only when the talker gets a request
    after the thinker has run."""
    with pytest.raises(ConfigError, match=r"stages\[1\]\.default_sampling_params\.frequency_penalty is not supported "
                                          r"by qwen3_talker"):
        cfg.load("m", "qwen3-omni-moe", {"1": {"default_sampling_params": {"frequency_penalty": 0.3}}})


@pytest.mark.parametrize("deploy, tiny", [("qwen3-omni-moe", "qwen3_omni"), ("qwen2.5-omni-7b", "qwen25_omni")])
def test_a_deploys_talker_stop_token_ids_past_its_codec_end_are_refused_at_load(tmp_path, monkeypatch, deploy, tiny):
    """The talker refuses stop_token_ids other than its codec's end (config_checks.talker_refusal): a deploy
    whose talker defaults named another code loaded, and every request then failed at the talker after the
    thinker ran. The same rule applies when the deploy loads (--dry-run too), naming the YAML key."""
    import collections
    import importlib

    config = importlib.import_module(f"omni.models.{tiny}.tiny").build_config(collections.defaultdict(int))
    ids = importlib.import_module(f"omni.models.{tiny}.edges").TalkerIds.from_config(config)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(config.to_json_string())
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    yaml_path = tmp_path / "d.yaml"
    yaml_path.write_text(f"base_config: {cfg.deploy_config_path(deploy)}\nstages:\n  - stage_id: 1\n"
                         f"    default_sampling_params: {{stop_token_ids: [{ids.codec_eos}, 3]}}\n")
    with pytest.raises(ConfigError, match=rf"d\.yaml: stages\[1\]\.default_sampling_params\.stop_token_ids is not "
                                          rf"supported by .*_talker: the talker stops at its codec's end .*; got "
                                          rf"\[{ids.codec_eos}, 3\]"):
        cfg.load(str(model), str(yaml_path))
    with pytest.raises(ConfigError, match=r"--stage-overrides: stages\[1\]\.default_sampling_params\.stop_token_ids"):
        cfg.load(str(model), deploy, {"1": {"default_sampling_params": {"stop_token_ids": [3]}}})
    ok = cfg.load(str(model), deploy, {"1": {"default_sampling_params": {"stop_token_ids": [ids.codec_eos]}}})
    assert ok.stages[1].default_sampling_params.stop_token_ids == (ids.codec_eos,)
    cfg.load(str(tmp_path / "absent"), str(yaml_path))   # the model not at hand: the talker checks


@pytest.mark.parametrize("deploy, stage, engine", [("smollm2-135m-instruct", 1, "piper_talker"),
                                                   ("lm-pooler", 1, "hidden_pooler"), ("qwen-image", 0, "qwen_image"),
                                                   ("wan2.1-t2v", 0, "wan")])
@pytest.mark.parametrize("key, value", [("temperature", 0.5), ("seed", 7), ("top_p", 1.0), ("max_tokens", 16)])
def test_default_sampling_an_engine_that_samples_no_tokens_ignores_is_refused_at_load(deploy, stage, engine, key,
                                                                                     value):
    """A Piper talker's (any config_checks.UNSAMPLED engine's) default_sampling_params temperature, seed ... were
    taken and ignored; they are refused naming the YAML key, as its sampling_params_list entry is."""
    with pytest.raises(ConfigError, match=rf"stages\[{stage}\]\.default_sampling_params\.{key} is not supported by "
                                          rf"{engine}: .*samples no tokens|stages\[{stage}\]\.default_sampling_params"
                                          rf"\.{key} is not supported by {engine}: a diffusion stage"):
        cfg.load("m", deploy, {str(stage): {"default_sampling_params": {key: value}}})


def test_piper_talkers_noise_scales_stay_its_own_sampling():
    c = cfg.load("m", "smollm2-135m-instruct", {"1": {"default_sampling_params": {"noise_scale": 0.5}}})
    assert c.stages[1].default_sampling_params.set() == {"noise_scale": 0.5, "noise_w_scale": 0.0}


def test_piper_talkers_noise_scales_are_range_checked():
    with pytest.raises(ConfigError, match=r"stages\[1\]\.default_sampling_params\.noise_scale must be finite and >= 0"):
        cfg.load("m", "smollm2-135m-instruct", {"1": {"default_sampling_params": {"noise_scale": float("inf")}}})


@pytest.mark.parametrize("key", ["noise_scale", "noise_w_scale"])
@pytest.mark.parametrize("deploy, stage, engine", [("smollm2-135m-instruct", 0, "torch_lm"),
                                                   ("smollm2-135m-instruct", 2, "piper_code2wav"),
                                                   ("qwen3-omni-moe", 1, "qwen3_talker"), ("lm-pooler", 1, "hidden_pooler")])
def test_piper_noise_scales_on_another_engines_stage_are_refused_at_load(deploy, stage, engine, key):
    """Only Piper's talker reads noise_scale / noise_w_scale; another stage's default naming one loaded and was
    ignored. It is refused naming the stage, the key and the engine."""
    with pytest.raises(ConfigError, match=rf"stages\[{stage}\]\.default_sampling_params\.{key} is not supported by "
                                          rf"{engine}: it is Piper's VITS noise prior, which only piper_talker reads"):
        cfg.load("m", deploy, {str(stage): {"default_sampling_params": {key: 0.5}}})


def test_the_shipped_deploys_still_load():
    for path in sorted(cfg.deploy_config_path("smollm2-135m-instruct").parent.glob("*.yaml")):
        cfg.load("m", path.stem)


@pytest.mark.parametrize("voices, default, ok", [("[chelsie, ethan]", "nosuch", False), ("[chelsie, ethan]", "Ethan", True),
                                                 ("[]", "joe", True)])
def test_a_default_voice_must_be_one_of_the_speakers(tmp_path, voices, default, ok):
    """default_voice outside voices loaded: every request naming no voice then got 404 "voice `None`"; a
    pipeline without speakers takes its voices from the voice store, unknown at load."""
    text = f"pipeline: {{voices: {voices}, default_voice: {default}}}\n" + STAGES
    if ok:
        assert load(tmp_path, text).pipeline.default_voice == default
        return
    with pytest.raises(ConfigError, match=r"pipeline\.default_voice 'nosuch' is not one of pipeline\.voices "
                                          r"\['chelsie', 'ethan'\]"):
        load(tmp_path, text)
