"""Run files (omni/runfile.py): only a folder of this user's alone is used, and nothing there is followed."""

from __future__ import annotations

import json
import logging
import os

import pytest

from omni import runfile


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    monkeypatch.setenv("OMNI_RUN_DIR", str(folder))
    return folder


def plant(folder) -> None:
    """What another user could leave in a shared folder: a live pid naming their master."""
    (folder / "1.json").write_text(json.dumps({"pid": os.getpid(), "master": "evil:1", "model": "m",
                                              "started": 1e12}))


def test_a_folder_others_may_write_is_not_used(run_dir, caplog):
    run_dir.chmod(0o777)
    plant(run_dir)
    with caplog.at_level(logging.WARNING, logger="omni.runfile"):
        assert runfile.write("127.0.0.1:5", "m", None) is None
        assert runfile.live_runs() == []
    assert [p.name for p in run_dir.iterdir()] == ["1.json"]     # nothing written there
    assert "mode 777" in caplog.text and "--master 127.0.0.1:5" in caplog.text


def test_a_folder_that_is_a_link_is_not_used(run_dir, tmp_path, monkeypatch):
    plant(run_dir)
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    monkeypatch.setenv("OMNI_RUN_DIR", str(link))
    assert runfile.write("127.0.0.1:5", "m", None) is None and runfile.live_runs() == []


def test_a_planted_temp_link_is_replaced_not_followed(run_dir, tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("keep")
    (run_dir / f"{os.getpid()}.tmp").symlink_to(sentinel)
    path = runfile.write("127.0.0.1:5", "m", "127.0.0.1:8000")
    assert sentinel.read_text() == "keep"
    assert path == run_dir / f"{os.getpid()}.json" and not path.is_symlink()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [r["master"] for r in runfile.live_runs()] == ["127.0.0.1:5"]
    runfile.remove(path)
    assert list(run_dir.iterdir()) == []


def test_a_bare_status_connects_with_the_runs_tls_files(run_dir):
    """`omni serve --tls-*` records the paths its processes connect with; a bare `omni status` uses them
    (given --tls-* win)."""
    from omni.master.auth import TlsFiles
    from omni.master.commands import _local_master

    path = runfile.write("127.0.0.1:5", "m", None, tls={"cert": None, "key": None, "ca": "/x/ca.pem"})
    assert _local_master() == ("127.0.0.1:5", TlsFiles(ca="/x/ca.pem"))
    given = TlsFiles(ca="/y/ca.pem")
    assert _local_master(tls=given) == ("127.0.0.1:5", given)
    runfile.remove(path)
    assert runfile.write("127.0.0.1:6", "m", None) and _local_master() == ("127.0.0.1:6", None)


def test_a_state_changing_command_refuses_to_pick_one_of_several_deployments(run_dir, capsys):
    """`omni drain/sleep/...` without --master acted on the newest of several `omni serve` on the host (only a
    stderr line said so); now it lists them and asks for --master (exit 2). `omni status` still shows the newest."""
    import typer

    from omni.master.commands import _local_master

    older = run_dir / "1.json"
    older.write_text(json.dumps({"pid": os.getppid(), "master": "127.0.0.1:7", "model": "old", "started": 1.0}))
    runfile.write("127.0.0.1:5", "new", None)
    with pytest.raises(typer.Exit) as e:
        _local_master("drain", only_one=True)
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "omni drain: 2 `omni serve` deployments run on this host; say which with --master:"
    assert err[1].startswith(f"  --master 127.0.0.1:5  (`omni serve new`, pid {os.getpid()}, started ")
    assert err[2].startswith(f"  --master 127.0.0.1:7  (`omni serve old`, pid {os.getppid()}, started 19")
    assert _local_master("status") == ("127.0.0.1:5", None)      # status: the newest, as before
    assert "the newest of 2 on this host" in capsys.readouterr().err
    older.unlink()
    assert _local_master("drain", only_one=True) == ("127.0.0.1:5", None)   # one: it is the one
