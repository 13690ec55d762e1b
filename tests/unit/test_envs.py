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
