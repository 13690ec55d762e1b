"""--dry-run says where each stage's model would load from, on stderr ("model: PATH" or "model: not found
(...)"), exit 0: a config is checked on a box without the weights too, and stdout stays the JSON. It said
nothing, and the real serve failed 11 s in ("neither a bundled model, a local directory nor ...")."""

from __future__ import annotations

import json

import pytest

from omni.cli import main
from omni.models import resolve


def dry_run(capsys, *args: str) -> tuple[dict, list[str]]:
    with pytest.raises(SystemExit) as e:
        main(["serve", *args, "--dry-run"])
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    return json.loads(out.out), [line for line in out.err.splitlines() if line.startswith("model: ")]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):   # resolve_model sets them: restored after the test
        monkeypatch.setenv(k, "1")
    # the host's own Hugging Face cache is not consulted: a box that holds Qwen3-Omni would show its snapshot
    monkeypatch.setattr(resolve, "_hf_cache_snapshot", lambda *a, **k: None)


def test_a_missing_model_is_named_and_the_dry_run_still_passes(capsys):
    _, lines = dry_run(capsys, "Qwen/Qwen3-Omni-30B-A3B-Instruct", "--omni")
    [line] = lines     # the thinker, talker and code2wav share the one model
    assert line.startswith("model: not found (model 'Qwen/Qwen3-Omni-30B-A3B-Instruct' is neither a bundled")


def test_a_folder_and_a_bundled_model_are_shown(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _, lines = dry_run(capsys, str(tmp_path))
    assert lines == [f"model: {tmp_path}"]
    _, lines = dry_run(capsys, "smollm2")   # the talker and code2wav are a Piper voice: no model line of theirs
    [line] = lines
    assert line.startswith("model: HuggingFaceTB/SmolLM2-135M-Instruct (bundled: ") and "at first use" in line
