"""The jobs folder under --state-dir holds the users' results: 0700 like the master's kv/ folder, also when an
older omni made it 0755."""

from __future__ import annotations

import stat

import pytest

from omni import config as cfg
from omni.launcher import LaunchPlan, Launcher


@pytest.mark.parametrize("existing", [False, True])
def test_the_jobs_folder_is_private(tmp_path, existing):
    if existing:
        (tmp_path / "jobs").mkdir(mode=0o755)
        (tmp_path / "jobs").chmod(0o755)
    launcher = Launcher(LaunchPlan(cfg.load("smollm2"), stages=[], port=0, state_dir=str(tmp_path)))
    try:
        launcher._plan_children()
        assert stat.S_IMODE((tmp_path / "jobs").stat().st_mode) == 0o700
    finally:
        launcher.shutdown()
