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
