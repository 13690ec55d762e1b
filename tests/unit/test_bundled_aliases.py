"""A deploy's aliases pick it (`omni serve smollm2`) and MODEL then names the weights: where the deploy's model
is a bundled one, each alias must resolve to it too. `omni serve smollm2` passed --dry-run, then its thinker
failed ("model 'smollm2' is neither a bundled model ...") after the master and two stages had started."""

from __future__ import annotations

import yaml

from omni.config import DEPLOY_DIR
from omni.models.resolve import find_bundled


def test_every_alias_of_a_bundled_models_deploy_finds_that_model():
    checked = 0
    for path in sorted(DEPLOY_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        entry = find_bundled(str(raw.get("model", "")))
        if entry is None:
            continue
        for alias in raw.get("aliases") or []:
            assert find_bundled(alias) is entry, (path.name, alias)
            checked += 1
    assert checked >= 2
