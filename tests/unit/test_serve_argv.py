"""`omni serve`'s MODEL as `vllm serve` takes it: `--model MODEL` ("unexpected argument" before), and vLLM's
`--config FILE.yaml` of flags ("--config: no stage of this pipeline takes it" before), spelled out as vLLM's
FlexibleArgumentParser does, the command line winning."""

from __future__ import annotations

import json

import pytest

from omni.cli import main
from omni.errors import ConfigError
from omni.serve_argv import load_config_file, normalise


def serve(capsys, *args: str) -> tuple[int, dict | None, str]:
    with pytest.raises(SystemExit) as e:
        main(["serve", *args, "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, json.loads(out.out) if e.value.code == 0 else None, out.err


def test_model_flag_is_model(capsys):
    for args in (["--model", "smollm2"], ["--model=smollm2"], ["smollm2", "--model", "smollm2"],
                 ["--max-num-seqs", "2", "--model", "smollm2"]):
        code, out, err = serve(capsys, *args)
        assert code == 0, (args, err)
        assert out["config"]["model"] == "smollm2"


def test_several_value_flags_take_their_words_with_model_flag(capsys):
    """With --model, as in vLLM's parser, `--api-key K1 K2` and `--served-model-name A B` take both words:
    the second was read as a MODEL and the refusal quoted it (an API key in an error)."""
    code, out, err = serve(capsys, "--model", "smollm2", "--served-model-name", "a", "b", "--api-key", "k1", "k2")
    assert code == 0, err
    assert out["config"]["model"] == "smollm2" and "k2" not in err


def test_two_models_or_none_are_refused_by_name(capsys):
    code, _, err = serve(capsys, "smollm2", "--model", "other")
    assert code == 2 and "MODEL smollm2 and --model other are two models" in err
    code, _, err = serve(capsys)
    assert code == 2 and "no model: give MODEL (omni serve MODEL ...), --model MODEL" in err


def test_config_file_is_read_as_vllms_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nmax_num_seqs: 7\nenable-prefix-caching: true\nenforce-eager: false\n"
                    "dry-run: false\ncudagraph-capture-sizes: [1, 2]\ncompilation-config: {mode: 0}\n"
                    "served-model-name: [a, b]\n")
    assert load_config_file(str(path)) == ("m", [
        "--max-num-seqs", "7", "--enable-prefix-caching", "--no-enforce-eager", "--cudagraph-capture-sizes", "1",
        "2", "--compilation-config", '{"mode": 0}', "--served-model-name", "a", "b"])
    # The file's flags right after MODEL: a flag given on the command line comes later and wins.
    assert normalise(["serve", "--port", "1", "--config", str(path), "--max-num-seqs", "3"]) == [
        "serve", "m", *load_config_file(str(path))[1], "--port", "1", "--max-num-seqs", "3"]
    assert normalise(["serve", "x", "--config", str(path)])[:2] == ["serve", "x"]   # the command line's MODEL
    # As vLLM: only the flag's name is respelled, not a dotted key's JSON path (rope_scaling, an env name).
    path.write_text("hf_overrides.rope_scaling.rope_type: yarn\nstage_overrides.0.env.MY_VAR: x\n")
    assert load_config_file(str(path))[1] == ["--hf-overrides.rope_scaling.rope_type", "yarn",
                                              "--stage-overrides.0.env.MY_VAR", "x"]


def test_config_file_errors_name_the_flag(tmp_path):
    for text, why in (("[1, 2]", "expected a mapping"), ("a: [b\n", "not valid YAML"), ("seed:\n", "seed: no value"),
                      ("config: x.yaml\n", "cannot name another"), ("api-key: [k1, k2]\n", "several API keys")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match=f"--config {tmp_path}/c.yaml: .*{why}"):
            normalise(["serve", "m", "--config", str(tmp_path / "c.yaml")])
    with pytest.raises(ConfigError, match="--config c.json: expected a YAML file of flags"):
        normalise(["serve", "m", "--config", "c.json"])
    with pytest.raises(ConfigError, match="--config .*/nope.yaml: cannot read it"):
        normalise(["serve", "m", "--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match="--config: given more than once"):
        normalise(["serve", "m", "--config", "a.yaml", "--config", "b.yaml"])


def test_config_file_serves_with_the_command_line_winning(capsys, tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("model: smollm2\nmax-num-seqs: 7\nmax-model-len: 1k\napi-key: secret-key\n")
    monkeypatch.setenv("OMNI_API_KEY", "")   # restored after: the file's key is put in the environment
    monkeypatch.delenv("OMNI_API_KEY")
    code, out, err = serve(capsys, "--config", str(path), "--max-num-seqs", "3")
    assert code == 0, err
    args = out["config"]["stages"][0]["engine_args"]
    assert args["max_num_seqs"] == 3 and args["max_model_len"] == 1000
    import os

    assert os.environ["OMNI_API_KEY"] == "secret-key" and "secret-key" not in err   # by environment, not argv


def test_config_file_shared_with_headless_nodes_drops_the_heads_flags(capsys, tmp_path):
    """One --config file on the head and every headless node, as with vLLM: the file's --host / --port ... are
    left out with a note ("--host, --port: not with --headless" before); the same flags typed are refused."""
    path = tmp_path / "b.yaml"
    path.write_text("port: 8000\nhost: 127.0.0.1\nmax-model-len: 1024\nserved-model-name: [a, b]\n"
                    "disable-control-routes: true\n")
    headless = ["smollm2", "--config", str(path), "--headless", "--stage-id", "1", "--omni-master-address",
                "127.0.0.1", "--omni-master-port", "1"]
    code, out, err = serve(capsys, *headless)
    assert code == 0, err
    assert ("--port, --host, --served-model-name, --disable-control-routes from --config "
            f"{path}: ignored with --headless") in err
    assert normalise(["serve", *headless])[:4] == ["serve", "smollm2", "--max-model-len", "1024"]   # the rest is read
    code, _, err = serve(capsys, *headless, "--port", "8000")
    assert code == 2 and "--port: not with --headless" in err
    path.write_text("headless: true\nport: 8000\n")   # --headless from the file itself
    assert normalise(["serve", "m", "--config", str(path), "--stage-id", "1"]) == [
        "serve", "m", "--headless", "--stage-id", "1"]
    path.write_text("port: 8000\n")
    assert normalise(["serve", "m", "--config", str(path)]) == ["serve", "m", "--port", "8000"]   # the head's
