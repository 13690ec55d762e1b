"""The model-family registry (omni/models/registry.py) is the one place a family is declared: every
bundled deploy belongs to one family (or is generic), every engine and processor a deploy names is
its family's, a folder of a family's model_type gets its deploy, and families share code only
through public names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from omni import config as cfg
from omni.engines import factory
from omni.engines.base import Engine
from omni.models import registry

OMNI = Path(cfg.__file__).resolve().parent


def _raw(name: str) -> dict:
    return cfg._load_raw(cfg.DEPLOY_DIR / name)


def test_every_bundled_deploy_belongs_to_one_family_or_is_generic():
    owners: dict[str, list[str]] = {}
    for f in registry.FAMILIES:
        for d in f.deploys:
            owners.setdefault(d, []).append(f.name)
    for d in registry.GENERIC_DEPLOYS:
        owners.setdefault(d, []).append("generic")
    bundled = sorted(p.name for p in cfg.DEPLOY_DIR.glob("*.yaml"))
    assert sorted(owners) == bundled
    assert all(len(v) == 1 for v in owners.values()), owners


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.name)
def test_a_familys_deploys_name_only_its_engines_and_processors(family):
    runtime = set(factory.ENGINES) - set(family.engines) - {n for n, _ in registry.engines().items()}
    for d in family.deploys:
        for s in _raw(d)["stages"]:
            assert s["engine"] in family.engines or s["engine"] in runtime, (d, s["engine"])
            if s.get("processor"):
                assert s["processor"] in family.processors, (d, s["processor"])
        voices = (_raw(d).get("pipeline") or {}).get("voices")
        if voices:
            assert tuple(voices) == family.voices
    for target in family.processors:
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("name", sorted(registry.engines()))
def test_every_family_engine_is_an_engine_the_factory_builds(name):
    family, spec = registry.engines()[name]
    cls = factory._load(spec.cls)
    assert issubclass(cls, Engine) and spec.cls.startswith(family.package + ".")
    assert name in factory.ENGINES and factory.accepted_args(name) is not None


@pytest.mark.parametrize("family", [f for f in registry.FAMILIES if f.tiny], ids=lambda f: f.name)
def test_a_tiny_folder_of_a_family_is_served_by_its_deploy(family, tmp_path):
    module, _, name = family.tiny.partition(":")
    folder = getattr(importlib.import_module(module), name)(tmp_path / "any-name")
    assert cfg.folder_model_type(folder) in family.model_types
    assert cfg.default_config_path(str(folder)).name == family.deploy


def test_a_folder_of_no_family_is_one_lm_stage(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert cfg.default_config_path(str(tmp_path)).name == registry.FOLDER_FALLBACK


def test_model_packages_use_only_public_names_of_each_other():
    """A family reaches another package's code through public names only (shared bases live in
    omni/models/*.py or omni/engines/, not in a family's private helpers)."""
    bad = []
    for path in (OMNI / "models").rglob("*.py"):
        own = ".".join(path.relative_to(OMNI.parent).with_suffix("").parts[:3])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omni.models."):
                if not node.module.startswith(own) and any(a.name.startswith("_") for a in node.names):
                    bad.append(f"{path.relative_to(OMNI)}: from {node.module} import "
                               + ", ".join(a.name for a in node.names))
    assert not bad, bad
