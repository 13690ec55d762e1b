"""benchmarks/token2wav_stream.py's default run on the tiny Qwen2.5 token2wav, shortened: it builds
its model and prints one JSON document whose whole decode is the reference of the streamed one."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_tiny_run_prints_its_figures(monkeypatch, capsys):
    from benchmarks import token2wav_stream

    monkeypatch.setattr("sys.argv", ["token2wav_stream.py", "--codes", "30", "--runs", "1", "--json"])
    token2wav_stream.main()
    out = capsys.readouterr()
    doc = json.loads(out.out)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert rows.keys() == {"whole", "streamed"} and doc["runs"] == 1 and doc["sweep"] == []
    assert rows["whole"]["max_abs_err"] == 0 and rows["streamed"]["rms_rel_err"] < 1e-3
    assert 0 < rows["streamed"]["first_audio_ms"] and 0 < rows["whole"]["rtf"]
    # each run and each row also went to stderr as it finished (a run cut at its limit keeps them)
    lines = [line for line in out.err.splitlines() if line.startswith("token2wav: ")]
    assert any(line.startswith("token2wav: engines built in ") for line in lines)
    for mode in ("whole", "streamed"):
        assert any(line.startswith(f"token2wav: {mode} run 1/1: first audio ") for line in lines)
        assert any(line.startswith(f"token2wav: {mode} medians: first audio {rows[mode]['first_audio_ms']:.1f} ms")
                   for line in lines)


@pytest.mark.parametrize("argv, message", [(["--quick", "--full"], "not allowed with"),
                                           (["--runs", "0"], "--codes, --runs and --streams must be >= 1"),
                                           (["--threads", "0"], "--threads must be >= 1, got 0")])
def test_bad_arguments_refused(monkeypatch, capsys, argv, message):
    from benchmarks import token2wav_stream

    monkeypatch.setattr("sys.argv", ["token2wav_stream.py", *argv])
    with pytest.raises(SystemExit) as e:
        token2wav_stream.main()
    assert e.value.code == 2 and message in capsys.readouterr().err
