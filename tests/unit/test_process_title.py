"""A test that calls omni.cli.main in-process with a secret on the command line has the pytest process's title
masked (setproctitle: "omni serve smollm2 --dry-run --api-key ***"); tests/conftest.py restores it after the
test, so `pgrep -f "omni serve"` does not find pytest. The two tests run in this order."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni.cli import main


def title() -> str:
    return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def test_main_in_process_masks_this_processes_title(capsys):
    pytest.importorskip("setproctitle")
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--dry-run", "--api-key", "SECRETzq"])
    assert e.value.code == 0, capsys.readouterr().err
    assert "omni serve smollm2 --dry-run --api-key ***" in title()


def test_the_title_is_restored_after_it():
    pytest.importorskip("setproctitle")
    assert "omni serve" not in title() and "SECRETzq" not in title(), title()
