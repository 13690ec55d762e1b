"""What a wheel of omni carries."""

import tomllib
from pathlib import Path

import omni
from omni import config as cfg


def test_the_bundled_deploys_are_package_data():
    """pyproject's package-data named omni/deploy/*.yaml while the files lay in the repo's deploy/:
    `pip install .` gave an omni with no bundled deploy (`omni serve MODEL` failed)."""
    pkg = Path(omni.__file__).resolve().parent
    globs = tomllib.loads((pkg.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["omni"]
    shipped = {p.resolve() for g in globs for p in pkg.glob(g)}
    bundled = {p.resolve() for p in cfg.DEPLOY_DIR.glob("*.yaml")}
    assert bundled and bundled <= shipped
    assert cfg.DEPLOY_DIR.resolve().is_relative_to(pkg)
