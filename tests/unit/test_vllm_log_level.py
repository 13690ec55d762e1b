"""omni's --log-level is vLLM's too (VLLM_LOGGING_LEVEL, which vLLM reads as it configures its logging, and
which the stages and their EngineCore inherit) unless the user set it: at omni's default WARNING, vLLM's INFO
lines (its config dump, every engine step's stats) printed anyway."""

from __future__ import annotations

import os
import time

import pytest

from omni.cli import main


def unset(monkeypatch) -> None:
    """VLLM_LOGGING_LEVEL unset for the test and restored after it: a delenv of an unset variable records
    nothing, so the value serve() sets would outlive the test."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "x")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")


def serve(*flags: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--dry-run", *flags])
    assert e.value.code == 0


@pytest.mark.parametrize("flags, want", [((), "WARNING"), (("--log-level", "debug"), "DEBUG")])
def test_omnis_level_is_vllms_when_the_user_set_none(monkeypatch, capsys, flags, want):
    unset(monkeypatch)
    serve(*flags)
    assert os.environ["VLLM_LOGGING_LEVEL"] == want


def test_the_users_own_value_wins(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    serve("--log-level", "ERROR")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_a_launched_child_gets_it(monkeypatch, capsys):
    """A launcher's child (a stage, a frontend) starts with this process's environment, so with the level."""
    import sys

    from omni.launcher import Child

    unset(monkeypatch)
    serve()
    child = Child("s0", "stage", [sys.executable, "-c",
                                  "import os, sys; print('level', os.environ.get('VLLM_LOGGING_LEVEL'), file=sys.stderr)"])
    child.start()
    assert child.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while "level WARNING" not in child.tail and time.monotonic() < deadline:   # its stderr pump's last line
        time.sleep(0.02)
    assert "level WARNING" in child.tail
