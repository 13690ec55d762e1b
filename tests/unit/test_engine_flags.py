"""`vllm serve`'s engine flags read on `omni serve` as vLLM reads them: human-readable integers
(--max-num-batched-tokens 8k was kept as the text '8k' and failed at the stage's start), short forms
(-q fp8, -pp 1, -O0 were "unexpected argument"; -dph printed --help) and dotted keys
(--compilation-config.mode 0 was "no stage of this pipeline takes it"). Checked against vLLM's own parser."""

from __future__ import annotations

import json

import pytest

from omni import config as cfg
from omni.cli import main
from omni.engine_flags import SERVE_SHORT_FLAGS, SEVERAL_VALUES, SHORT_FLAGS, parse_extra_flags, spell_out
from omni.errors import ConfigError


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def omni_parse(argv: list[str]) -> dict:
    return parse_extra_flags(spell_out(argv))


def same(ours, theirs) -> bool:
    """omni's value (a JSON object for vLLM's config classes) against what vLLM's parser made of it."""
    if isinstance(ours, dict) and not isinstance(theirs, dict):
        return all(same(v, getattr(theirs, k)) for k, v in ours.items())
    if isinstance(ours, dict):
        return ours.keys() <= theirs.keys() and all(same(v, theirs[k]) for k, v in ours.items())
    if isinstance(theirs, str) and isinstance(ours, int):
        return str(ours) == theirs      # --optimization-level: vLLM's parser keeps the text, EngineArgs reads it
    return ours == theirs


VLLM_ARGVS = [
    ["--max-num-batched-tokens", "8k", "--kv-cache-memory-bytes", "1G"],
    ["--max-num-batched-tokens=25.6k", "--max-num-scheduled-tokens", "4K", "--max-num-queued-tokens", "2m"],
    ["--safetensors-prefetch-block-size", "16M", "--max-num-batched-tokens", "8192"],
    ["-q", "fp8", "-pp", "1", "-dp", "2", "-dcp", "1", "-ep", "-O0"],
    ["-O", "3", "-tp", "2", "-dph", "-dpe"],
    ["-O=2", "-dpm", "-dpa", "10.0.0.1", "-dpb", "mp", "-n", "2", "-r", "1"],
    ["--compilation-config.mode", "0", "--compilation-config.max_cudagraph_capture_size", "1k"],
    ["-cc.mode=3"],
    ["--limit-mm-per-prompt.audio", "1", "--limit-mm-per-prompt.image=2"],
    ["-sc", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
    ["--compilation-config", '{"max_cudagraph_capture_size": 2k}'],
]


@pytest.mark.parametrize("argv", VLLM_ARGVS, ids=" ".join)
def test_engine_flags_read_as_vllms_parser_reads_them(vllm_parser, argv):
    ours = omni_parse(argv)
    theirs = vllm_parser.parse_args(argv)
    assert ours
    for key, value in ours.items():
        assert same(value, getattr(theirs, key)), (key, value, getattr(theirs, key))


def test_the_short_forms_are_vllms(vllm_parser):
    theirs = {short: next(o for o in a.option_strings if o.startswith("--"))
              for a in vllm_parser._actions for short in a.option_strings
              if not short.startswith("--") and short != "-h"}
    assert SHORT_FLAGS == theirs


@pytest.mark.parametrize("argv, n", [
    (["--max-num-batched-tokens", "8k"], 8000), (["--max-num-batched-tokens", "8K"], 8192),
    (["--kv-cache-memory-bytes=1G"], 1 << 30), (["--kv-cache-memory-bytes", "1.5g"], 1_500_000_000),
    (["--max-num-batched-tokens", "2048"], 2048), (["--max-num-batched-tokens", "1t"], 10**12)])
def test_human_readable_integers_become_numbers(argv, n):
    assert list(parse_extra_flags(argv).values()) == [n]


@pytest.mark.parametrize("value", ["1.5K", "lots", "8kb", "1e3", "true", "-"])
def test_what_is_not_a_human_readable_integer_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match="--max-num-batched-tokens: .* is not an integer: 8192, 8k"):
        parse_extra_flags([f"--max-num-batched-tokens={value}"])


def test_dotted_keys_fold_into_the_flags_json_object():
    assert parse_extra_flags(["--compilation-config", '{"mode": 1, "x": {"a": 1}}', "--compilation-config.x.b", "2",
                              "--compilation-config.sizes+", "1,2", "--compilation-config.sizes+", "4"]) == {
        "compilation_config": {"mode": 1, "x": {"a": 1, "b": 2}, "sizes": ["1", "2", "4"]}}
    assert parse_extra_flags(["--kv-transfer-config.cpu_bytes_to_use", "80m"]) == {
        "kv_transfer_config": {"cpu_bytes_to_use": 80_000_000}}
    with pytest.raises(ConfigError, match="--compilation-config.mode: --compilation-config is given a value that is "
                                          "not a JSON object"):
        parse_extra_flags(["--compilation-config", "3", "--compilation-config.mode", "0"])
    with pytest.raises(ConfigError, match="--compilation-config..mode: empty key"):
        parse_extra_flags(["--compilation-config..mode", "0"])
    with pytest.raises(ConfigError, match="--compilation-config.mode: expected a value"):
        parse_extra_flags(["--compilation-config.mode"])


def test_spell_out_leaves_what_is_not_a_short_form():
    argv = ["serve", "m", "-oma", "h", "-Q", "--quiet", "--", "-q"]
    assert spell_out(argv, {"-oma": "--omni-master-address"}) == [
        "serve", "m", "--omni-master-address", "h", "-Q", "--quiet", "--", "-q"]
    assert spell_out(["-O", "fast"]) == ["-O", "fast"]    # -O takes 0-3 as its next word only, as vLLM


def test_a_serve_options_value_is_never_spelled_out(monkeypatch, capsys):
    """spell_out rewrote every token: `--api-key -q` set the key to '--quantization', `--served-model-name -n`
    served '--nnodes', a key starting with -O became --optimization-level and the key its rest."""
    argv = ["serve", "m", "--api-key", "-q", "--served-model-name", "-n", "--api-key", "-Oa1B2", "-oma", "-tp",
            "--engine-args.x", "-q", "-q", "fp8", "-O3"]
    assert spell_out(argv, {"-oma": "--omni-master-address"}) == [
        "serve", "m", "--api-key", "-q", "--served-model-name", "-n", "--api-key", "-Oa1B2",
        "--omni-master-address", "-tp", "--engine-args.x", "-q", "--quantization", "fp8", "--optimization-level", "3"]
    import omni.cli as cli

    seen = {}
    keys, names = cli._api_keys, cli._served_names
    monkeypatch.setattr(cli, "_api_keys", lambda v: (seen.setdefault("keys", v), keys(v))[1])
    monkeypatch.setattr(cli, "_served_names", lambda v: (seen.setdefault("names", v), names(v))[1])
    for flag, value, key in (("--api-key", "-q", "keys"), ("--served-model-name", "-n", "names"),
                             ("--api-key", "-Oa1B2", "keys"), ("--api-key", "-oma", "keys")):
        seen.clear()
        with pytest.raises(SystemExit) as e:
            main(["serve", "smollm2", "--dry-run", flag, value])
        assert e.value.code == 0, capsys.readouterr().err
        assert seen[key] == [value]


def serve(capsys, *flags: str) -> tuple[int, dict | None, str]:
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2-vllm", *flags, "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, json.loads(out.out) if e.value.code == 0 else None, out.err


def test_vllm_serve_flags_reach_the_vllm_stage_as_vllm_reads_them(capsys):
    pytest.importorskip("vllm")
    code, out, err = serve(capsys, "--max-num-batched-tokens", "8k", "--kv-cache-memory-bytes", "1G", "-q", "fp8",
                           "-pp", "1", "-O0", "-dph", "--compilation-config.mode", "0",
                           "--limit-mm-per-prompt.audio", "1")
    assert code == 0, err
    args = out["config"]["stages"][0]["engine_args"]
    assert {k: args[k] for k in ("max_num_batched_tokens", "kv_cache_memory_bytes", "quantization",
                                 "pipeline_parallel_size", "optimization_level", "data_parallel_hybrid_lb",
                                 "compilation_config", "limit_mm_per_prompt")} == {
        "max_num_batched_tokens": 8000, "kv_cache_memory_bytes": 1 << 30, "quantization": "fp8",
        "pipeline_parallel_size": 1, "optimization_level": 0, "data_parallel_hybrid_lb": True,
        "compilation_config": {"mode": 0}, "limit_mm_per_prompt": {"audio": 1}}
    code, _, err = serve(capsys, "--max-num-batched-tokens", "8 k")
    assert code == 2 and "--max-num-batched-tokens: '8 k' is not an integer" in err, err


def test_deploy_engine_args_human_readable_integers_become_numbers(tmp_path):
    path, base = tmp_path / "d.yaml", cfg.DEPLOY_DIR / "smollm2-135m-instruct-vllm.yaml"
    path.write_text(f"base_config: {base}\nstages:\n- stage_id: 0\n  max_num_batched_tokens: 4k\n"
                    "  engine_args: {kv_cache_memory_bytes: 512M}\n")
    args = cfg.load("smollm2-vllm", str(path)).stages[0].engine_args
    assert (args["max_num_batched_tokens"], args["kv_cache_memory_bytes"]) == (4000, 512 << 20)
    over = cfg.load("smollm2-vllm", None, {"0": {"max_num_scheduled_tokens": "2K"}}).stages[0].engine_args
    assert over["max_num_scheduled_tokens"] == 2048
    path.write_text(f"base_config: {base}\nstages:\n- stage_id: 0\n  max_num_batched_tokens: 4kb\n")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.engine_args\.max_num_batched_tokens: '4kb' is not an "
                                          "integer"):
        cfg.load("smollm2-vllm", str(path))


def test_engine_args_json_in_stage_mode_reads_human_readable_integers(capsys):
    """A headless stage's --engine-args JSON reached its engine as the text '8k' (apply_engine_flags)."""
    head = ["--stage-id", "0", "--headless", "--omni-master-address", "127.0.0.1", "--omni-master-port", "1"]
    code, out, err = serve(capsys, *head, "--engine-args", '{"max_num_batched_tokens": "8k"}')
    assert code == 0, err
    assert out["engine_flags"]["max_num_batched_tokens"] == 8000
    code, _, err = serve(capsys, *head, "--engine-args", '{"max_num_batched_tokens": "8 k"}')
    assert code == 2 and "--engine-args max_num_batched_tokens: '8 k' is not an integer" in err, err


@pytest.mark.parametrize("argv, key, value", [
    (["--cudagraph-capture-sizes", "1", "2", "4"], "cudagraph_capture_sizes", [1, 2, 4]),
    (["--cudagraph-capture-sizes", "8"], "cudagraph_capture_sizes", [8]),
    (["--cudagraph-capture-sizes=8"], "cudagraph_capture_sizes", [8]),
    (["--ignore-patterns", "a/*", "b/**", "--max-num-seqs", "2"], "ignore_patterns", ["a/*", "b/**"]),
    (["--allowed-media-domains", "a.com", "b.com"], "allowed_media_domains", ["a.com", "b.com"]),
])
def test_several_value_flags_take_the_words_after_them_as_a_list(argv, key, value):
    """--cudagraph-capture-sizes 1 2 4 was "unexpected argument '2'", and one value a scalar where vLLM has a list."""
    assert parse_extra_flags(argv)[key] == value
    with pytest.raises(ConfigError, match="--ignore-patterns: expected one or more values"):
        parse_extra_flags(["--ignore-patterns", "--max-num-seqs", "2"])


def test_the_several_value_flags_are_vllms(vllm_parser):
    """The table is what vLLM's serve parser takes several values for (serve's own --api-key and
    --served-model-name aside), with vllm-omni's --lora-path."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    theirs = {a.dest for a in make_arg_parser(FlexibleArgumentParser())._actions if a.nargs in ("+", "*")}
    assert SEVERAL_VALUES == theirs - {"api_key", "served_model_name"} | {"lora_path"}
    assert omni_parse(["--cudagraph-capture-sizes", "1", "2"])["cudagraph_capture_sizes"] == \
        vllm_parser.parse_args(["--cudagraph-capture-sizes", "1", "2"]).cudagraph_capture_sizes


def test_several_values_reach_the_vllm_stage_as_a_list(capsys):
    code, out, err = serve(capsys, "--cudagraph-capture-sizes", "1", "2", "4", "--ignore-patterns", "x/*")
    assert code == 0, err
    args = out["config"]["stages"][0]["engine_args"]
    assert args["cudagraph_capture_sizes"] == [1, 2, 4] and args["ignore_patterns"] == ["x/*"]


def test_the_serve_short_forms_are_vllms():
    """vLLM serve's own short form -asc (--api-server-count) was 'unexpected argument'; every short form of
    its serve parser is spelled out."""
    pytest.importorskip("vllm")
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser(FlexibleArgumentParser())
    theirs = {short: next(o for o in a.option_strings if o.startswith("--"))
              for a in parser._actions for short in a.option_strings
              if not short.startswith("--") and short != "-h"}
    assert {**SHORT_FLAGS, **SERVE_SHORT_FLAGS} == theirs


def test_asc_is_api_server_count(capsys):
    assert spell_out(["serve", "m", "-asc", "2", "-asc=3", "--api-key", "-asc"]) == [
        "serve", "m", "--api-server-count", "2", "--api-server-count=3", "--api-key", "-asc"]
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "-asc", "2", "--port", "0", "--dry-run"])
    assert e.value.code == 0, capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "-asc", "0", "--dry-run"])
    assert e.value.code == 2
    assert "--api-server-count must be >= 1" in capsys.readouterr().err
