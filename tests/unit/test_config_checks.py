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
    ("noise_scale", ".inf", "finite and >= 0"), ("stop_token_ids", "[-1]", "non-negative"),
])
def test_stage_sampling_defaults_get_the_apis_ranges(tmp_path, key, value, wanted):
    stages = STAGES.replace("final_output: true", f"default_sampling_params: {{{key}: {value}}}, final_output: true")
    with pytest.raises(ConfigError, match=rf"stages\[0\]\.default_sampling_params\.{key} must be {wanted}"):
        load(tmp_path, stages)



@pytest.mark.parametrize("engine, refused", [("qwen3_talker", True), ("qwen25_talker", True), ("piper_talker", False),
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
