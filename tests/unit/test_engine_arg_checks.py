"""A deploy's stages are checked against their engines at load (omni/config_engines.py), so `omni serve
--dry-run` refuses what the stage process would refuse only once the master, the frontends and the other
stages were up; the extra engine flags are typed by the same annotations (a bare --seed is no seed)."""

import inspect
import json
import os
import subprocess
import sys

import pytest

from omni.cli import main
from omni.engines.vllm.args import engine_arg_fields
from tests.e2e.harness import REPO


def dry_run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", *args, "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def deploy(tmp_path, stage0: str) -> str:
    path = tmp_path / "late.yaml"
    path.write_text(f"base_config: smollm2-135m-instruct.yaml\nstages:\n  - {{stage_id: 0, {stage0}}}\n")
    return str(path)


@pytest.mark.parametrize("stage0, message", [
    ("engine: torch_lmm", "stages[0].engine: unknown engine 'torch_lmm' (known: hidden_pooler, "),
    ('processor: "no.such.module:fn"', "stages[0].processor: 'no.such.module:fn': module 'no.such.module' cannot "
                                       "be imported"),
    ('processor: "omni.processors:nope"', "stages[0].processor: 'omni.processors:nope': module 'omni.processors' "
                                          "has no function 'nope'"),
    ("processor: omni.processors", "stages[0].processor: 'omni.processors' is not 'module:function'"),
    ("engine_args: {max_model_len: -1}", "stages[0].engine_args.max_model_len must be an integer >= 1, got -1"),
    ("engine_args: {bogus_arg: 1}", "stages[0].engine_args.bogus_arg: engine torch_lm does not take it, nor does any "
                                    "other engine (it takes dtype, "),
    ("engine_args: {seed: x}", "stages[0].engine_args.seed must be an integer, got 'x'"),
    ("engine_args: {seed: true}", "stages[0].engine_args.seed must be an integer, got true"),
    ("engine_args: {tensor_parallel_size: 2}", "stages[0].engine_args: engine torch_lm runs on one device per "
                                               "replica; tensor_parallel_size=2 is not supported"),
])
def test_what_the_stage_would_refuse_at_start_is_refused_at_load(tmp_path, capsys, stage0, message):
    """/tmp/fuzzcfg/late.yaml's keys, one at a time: each passed --dry-run (rc 0)."""
    code, _, err = dry_run(capsys, "--deploy-config", deploy(tmp_path, stage0))
    assert code == 2 and f"late.yaml: {message}" in err, err


@pytest.mark.parametrize("key", ["runtime", "engine_extras", "input_connectors"])
def test_a_stage_override_no_engine_takes_is_refused_naming_the_flag(capsys, key):
    """A --stage-overrides key that is no stage field lands in engine_args, where torch_lm refused it at start."""
    code, _, err = dry_run(capsys, "--stage-overrides", json.dumps({"0": {key: "x"}}))
    assert code == 2 and f"--stage-overrides: stages[0].engine_args.{key}: engine torch_lm does not take it" in err


@pytest.mark.parametrize("flags, message", [
    (["--seed"], "--seed needs a value (an integer) (for stage 0 (thinker), engine torch_lm)"),
    (["--seed", "x"], "--seed: expected an integer, got 'x'"),
    (["--seed=1.5"], "--seed: expected an integer, got 1.5"),
    (["--deploy-config", "smollm2-135m-instruct-vllm", "--seed"], "--seed needs a value (an integer) (for stage 0 "
                                                                  "(thinker), engine vllm)"),
])
def test_an_extra_flag_of_the_wrong_type_is_refused_naming_it(capsys, flags, message):
    """A bare --seed was `seed: true` in the dry run's config, and torch's manual_seed refused the bool at start."""
    code, _, err = dry_run(capsys, *flags)
    assert code == 2 and f"omni: error: {message}" in err, err


@pytest.mark.parametrize("flags, stage0", [
    (["--seed", "3"], {"seed": 3}),
    (["--deploy-config", "smollm2-135m-instruct-vllm", "--enforce-eager", "--seed", "7"],
     {"enforce_eager": True, "seed": 7}),
    # vLLM's optional_type: None or '' unsets an optional field (typed `int | None`); it was refused as text
    (["--deploy-config", "smollm2-135m-instruct-vllm", "--block-size", "None"], {"block_size": None}),
    (["--deploy-config", "smollm2-135m-instruct-vllm", "--block-size", ""], {"block_size": None}),
])
def test_an_extra_flag_of_the_right_type_passes(capsys, flags, stage0):
    code, out, err = dry_run(capsys, *flags)
    assert code == 0, err
    assert stage0.items() <= json.loads(out)["config"]["stages"][0]["engine_args"].items()


def test_load_reads_vllms_engine_args_without_importing_vllm():
    """Importing vllm.engine.arg_utils takes 10-20 s here: load reads EngineArgs' fields from its source."""
    code = ("import sys; from omni import config; "
            "c = config.load('smollm2', 'smollm2-135m-instruct-vllm', {'0': {'enforce_eager': True}}); "
            "print(c.stages[0].engine, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["vllm", "False"], out.stderr


def test_the_fields_read_from_vllms_source_are_its_engine_args():
    pytest.importorskip("vllm")
    from omni.engines.vllm.args import engine_arg_names

    assert set(engine_arg_fields()) == engine_arg_names()
    assert engine_arg_fields()["seed"] == "int"


def test_without_vllm_a_key_no_engine_here_takes_is_left_to_the_stage(monkeypatch):
    """vllm-omni's deploys give every stage enable_prefix_caching; on a host without vLLM (a head with no
    stage of its own, a dry-run on a laptop) it is no key any engine here takes, and the load refused it."""
    from omni import config
    from omni.engines import factory

    real = factory.accepted_args
    monkeypatch.setattr(factory, "accepted_args", lambda engine: None if engine == "vllm" else real(engine))
    c = config.load("smollm2", None, {"1": {"engine_args": {"enable_prefix_caching": True}}})
    assert c.stages[1].engine_args["enable_prefix_caching"] is True


def test_omni_masters_config_load_does_not_import_torch():
    """The standalone master builds no engine: it loads its deploy without the engine check (torch: 65 ->
    268 MB resident, 0.4 -> 1.3 s to listen)."""
    code = ("import sys; from omni.master.commands import _load_config; "
            "c = _load_config('omni/deploy/qwen3-omni-moe.yaml'); print(len(c['stages']), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "OMNI_PLATFORM": "cpu"})
    assert out.stdout.split() == ["3", "False"], out.stderr[-2000:]


def test_one_signature_read_gives_an_engines_keywords_their_types_and_any_kwargs(monkeypatch):
    from omni.engines import factory

    class Engine:
        def __init__(self, weights, *, threads: "int" = 1, device="cpu", **extra):
            pass

    monkeypatch.setitem(factory.ENGINE_CLASSES, "fake", "fake_engine_module:Engine")
    monkeypatch.setattr(factory, "_load", lambda target: Engine)
    assert factory._init_keywords("fake") == ({"threads": "int", "device": inspect.Parameter.empty}, True)
    assert factory.accepted_args("fake") is None and factory.arg_types("fake") == {"threads": "int"}
    monkeypatch.undo()
    keywords, any_key = factory._init_keywords("torch_lm")
    assert not any_key and factory.accepted_args("torch_lm") == frozenset(keywords)
    assert factory.arg_types("torch_lm") == {k: a for k, a in keywords.items() if isinstance(a, str)}
    assert factory._init_keywords("vllm") is None and factory._init_keywords("nope") is None
