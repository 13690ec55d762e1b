"""An extra flag refused or ignored is named as the user typed it: parse_extra_flags reads both `--no-x` and
`--x false` as x = false, and the messages named either one `--no-x` (engine_flags.namer)."""

from __future__ import annotations

import pytest

from omni.cli import main
from omni.engine_flags import parse_extra_flags

MASTER = ["--omni-master-address", "127.0.0.1", "--omni-master-port", "1"]


def serve(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", *args, "--dry-run"])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flag, message", [
    (["--such-flag", "false"], "--such-flag: no stage of this pipeline takes it"),
    (["--such-flag=false"], "--such-flag: no stage of this pipeline takes it"),
    (["--no-such-flag"], "--no-such-flag: no stage of this pipeline takes it"),
    (["--no-such-flag", "false"], "--no-such-flag: no stage of this pipeline takes it"),
    (["--diffusion-compile-dynamic", "false"], "--diffusion-compile-dynamic: vllm-omni's diffusion option"),
    (["--no-diffusion-compile-dynamic"], "--no-diffusion-compile-dynamic: vllm-omni's diffusion option"),
])
def test_a_false_flag_no_engine_takes_is_refused_as_typed(capsys, flag, message):
    code, err = serve(capsys, *flag)
    assert code == 2 and f"omni: error: {message}" in err, err


@pytest.mark.parametrize("mode", [[], ["--stage-id", "2", "--headless", *MASTER]], ids=["single", "stage"])
def test_a_false_flag_that_is_ignored_is_named_as_typed(capsys, mode):
    code, err = serve(capsys, *mode, "--enable-sleep-mode", "false")
    assert code == 0 and "omni: --enable-sleep-mode: " in err and "--no-enable-sleep-mode" not in err, err


def test_a_stage_flag_is_refused_as_typed(capsys):
    code, err = serve(capsys, "--stage-id", "0", *MASTER, "--such-flag", "false")
    assert code == 2 and "omni: error: --such-flag: stage 0's engine (torch_lm) does not take it" in err, err


def test_parse_records_each_flag_as_typed():
    typed: dict[str, str] = {}
    assert parse_extra_flags(["--a", "false", "--no-b", "--c=1", "--d.e", "2"], typed) == {
        "a": False, "b": False, "c": 1, "d": {"e": 2}}
    assert typed == {"a": "--a", "b": "--no-b", "c": "--c"}
