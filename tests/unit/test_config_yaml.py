"""YAML a user gives omni (a deploy, vLLM's --config FILE) is read with a bound on what its aliases expand to:
a 549-byte deploy of nested aliases took 31 s and 7 GB before a MemoryError traceback."""

from __future__ import annotations

import pytest

from omni import config as cfg
from omni.config_yaml import MAX_NODES
from omni.errors import ConfigError
from omni.serve_argv import load_config_file


def nested_aliases(levels: int, indent: str = "") -> str:
    """10**levels leaves in a few hundred bytes."""
    lines = [f'{indent}a0: &a0 [{", ".join(["lol"] * 10)}]']
    lines += [f'{indent}a{i}: &a{i} [{", ".join([f"*a{i - 1}"] * 10)}]' for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_deploy_whose_aliases_expand_past_the_bound_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("base_config: smollm2-135m-instruct.yaml\nstages:\n- stage_id: 0\n  engine_args:\n"
                    + nested_aliases(6, "    "))   # 10**6 leaves: loaded, and expanded by every copy after
    assert path.stat().st_size < 600
    with pytest.raises(ConfigError, match=rf"^{path}: the YAML expands to more than {MAX_NODES} nodes"):
        cfg.load("smollm2", str(path))


def test_an_alias_that_refers_to_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("base_config: smollm2-135m-instruct.yaml\nloop: &l [*l]\n")
    with pytest.raises(ConfigError, match=rf"^{path}: the YAML expands to more than"):
        cfg.load("smollm2", str(path))


def test_a_few_aliases_still_load(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("base_config: smollm2-135m-instruct.yaml\nstages:\n- stage_id: 0\n  engine_args: &a {max_num_seqs: 3}\n"
                    "- stage_id: 2\n  engine_args: *a\n")
    config = cfg.load("smollm2", str(path))
    assert config.stages[0].engine_args["max_num_seqs"] == config.stages[2].engine_args["max_num_seqs"] == 3


def test_vllms_config_file_is_bounded_too(tmp_path):
    path = tmp_path / "flags.yaml"
    path.write_text("model: smollm2\n" + nested_aliases(6))
    with pytest.raises(ConfigError, match=rf"^--config {path}: the YAML expands to more than {MAX_NODES} nodes"):
        load_config_file(str(path))
