"""omni.envs reads each variable when asked, so a value set after import counts."""

from __future__ import annotations

import pytest

from omni import envs


def test_values_are_read_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("OMNI_CONTROL_ROUTES", raising=False)
    monkeypatch.delenv("OMNI_CONTROL_API_KEY", raising=False)
    assert envs.OMNI_CONTROL_ROUTES is True and envs.OMNI_CONTROL_API_KEY is None
    monkeypatch.setenv("OMNI_CONTROL_ROUTES", "off")
    monkeypatch.setenv("OMNI_CONTROL_API_KEY", "k")
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    assert envs.OMNI_CONTROL_ROUTES is False and envs.OMNI_CONTROL_API_KEY == "k"
    assert envs.OMNI_CACHE_DIR == str(tmp_path)
    from omni.models.smollm2 import cache_dir
    assert cache_dir() == tmp_path / "models"


def test_an_unknown_variable_is_an_attribute_error():
    with pytest.raises(AttributeError, match="OMNI_NOPE"):
        envs.OMNI_NOPE  # noqa: B018
    assert "OMNI_TOKEN" in dir(envs)


def test_spin_us_defaults_to_50_and_a_bad_value_names_the_variable(monkeypatch):
    from omni.errors import ConfigError

    monkeypatch.delenv("OMNI_SPIN_US", raising=False)
    assert envs.OMNI_SPIN_US == 50
    monkeypatch.setenv("OMNI_SPIN_US", "0")
    assert envs.OMNI_SPIN_US == 0
    for bad in ("fast", "-1", "10001", "1.5"):
        monkeypatch.setenv("OMNI_SPIN_US", bad)
        with pytest.raises(ConfigError, match=f"OMNI_SPIN_US='{bad}'"):
            envs.OMNI_SPIN_US  # noqa: B018


def test_api_keys_come_as_a_json_list_else_one_key(monkeypatch):
    from omni.errors import ConfigError

    monkeypatch.delenv("OMNI_API_KEYS", raising=False)
    monkeypatch.delenv("OMNI_API_KEY", raising=False)
    assert envs.OMNI_API_KEYS == []
    monkeypatch.setenv("OMNI_API_KEY", "one key, not split")
    assert envs.OMNI_API_KEYS == ["one key, not split"]
    monkeypatch.setenv("OMNI_API_KEYS", '["a b", "c\\nd", "[e]"]')
    assert envs.OMNI_API_KEYS == ["a b", "c\nd", "[e]"]          # the launcher's list wins
    monkeypatch.setenv("OMNI_API_KEYS", "[]")
    assert envs.OMNI_API_KEYS == []
    for bad in ("s3cret", '["s3cret", ""]', '{"k": "s3cret"}', '[1]'):
        monkeypatch.setenv("OMNI_API_KEYS", bad)
        with pytest.raises(ConfigError, match="OMNI_API_KEYS: expected a JSON list") as e:
            envs.OMNI_API_KEYS  # noqa: B018
        assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("value", ["gpu", "rocm", "cuda0"])
def test_an_unknown_platform_is_refused_naming_the_variable(monkeypatch, value):
    """OMNI_PLATFORM=gpu picked no platforms.<name> section: `omni serve` ran the GPU values on a CPU host, exit 0."""
    from omni import config as cfg
    from omni.errors import ConfigError

    monkeypatch.setenv("OMNI_PLATFORM", value)
    with pytest.raises(ConfigError, match=rf"^OMNI_PLATFORM='{value}': expected cpu or cuda"):
        cfg.load("smollm2-vllm")
    for given, platform in ((" CUDA ", "cuda"), ("cpu", "cpu")):
        monkeypatch.setenv("OMNI_PLATFORM", given)
        assert cfg.current_platform() == platform
