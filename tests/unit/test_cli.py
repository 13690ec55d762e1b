"""The CLI refuses bad flag combinations with a message naming the flag, fast."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO


def omni(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


HEADLESS = ["serve", "smollm2", "--stage-id", "1", "--headless", "--omni-master-address", "127.0.0.1",
            "--omni-master-port", "1", "--dry-run"]


@pytest.mark.parametrize("args, message", [
    (["serve", "smollm2", "--headless"], "--headless needs --stage-id"),
    (["serve", "smollm2", "--stage-id", "1", "--headless"], "--stage-id needs --omni-master-address"),
    (["serve", "smollm2", "--stage-id", "7", "--headless", "--omni-master-address", "127.0.0.1",
      "--omni-master-port", "1"], "--stage-id 7"),
    (["serve", "smollm2", "--stage-overrides", "{bad"], "--stage-overrides: not valid JSON"),
    (["serve", "smollm2", "--stage-overrides.5.x", "1"], "unknown stage 5"),
    (["serve", "smollm2", "--api-server-count", "0"], "--api-server-count must be >= 1"),
    (["serve", "smollm2", "--num-replicas", "0"], "--num-replicas must be >= 1 (0 only on the head"),
    (["serve", "smollm2", "--stage-id", "1", "--headless", "--omni-master-address", "127.0.0.1",
      "--omni-master-port", "1", "--num-replicas", "0"], "--num-replicas must be >= 1"),
    (["serve", "no/such-model"], "no bundled deploy config"),
    (["serve", "smollm2", "--deploy-config", "/nonexistent.yaml"], "file not found"),
    (["serve", "smollm2", "--control-api-key", "k", "--disable-control-routes"], "contradict"),
    (["serve", "smollm2", "--port", "99999"], "--port must be a TCP port, 0-65535"),
    (["serve", "smollm2", "--log-level", "debugx"], "--log-level must be one of DEBUG"),
    (["serve", "smollm2", "--stage-id", "1", "--headless", "--omni-master-address", "127.0.0.1",
      "--omni-master-port", "70000"], "--omni-master-port must be a TCP port"),
    (["master", "--port", "99999"], "--port must be a TCP port"),
    (["master", "--port", "0", "--tls-cert", os.devnull, "--tls-key", os.devnull],
     f"--tls-cert {os.devnull}: not a PEM certificate"),
    (["master", "--port", "0", "--tls-ca", os.devnull], "--tls-cert and --tls-key: a TLS master needs both"),
    (["serve", "smollm2", "--max-request-bytes", "10"], "--max-request-bytes must be at least 1024"),
    (["serve", "smollm2", "--api-key", ""], "--api-key is empty"),
    (["serve", "smollm2", "--control-api-key="], "--control-api-key is empty"),
    (["serve", "smollm2", "--api-key", "k1", "", "--port", "0"], "--api-key is empty"),
    (["serve", "smollm2", "--served-model-name", "a", ""], "--served-model-name: a name is empty"),
    # a state dir the master cannot use: refused before anything starts, not its OSError traceback
    (["serve", "smollm2", "--port", "0", "--state-dir", os.devnull], f"--state-dir {os.devnull}: cannot keep"),
    (["serve", "smollm2", "--state-dir", f"{os.devnull}/omni", "--dry-run"], "--state-dir /dev/null/omni: cannot"),
    (["master", "--port", "0", "--state-dir", "/proc/nope"], "--state-dir /proc/nope: cannot keep"),
    # counts an engine refuses below 1: refused by --dry-run too, naming the flag as typed (they had failed only
    # when the stage started)
    (["serve", "smollm2", "--max-num-seqs", "0", "--dry-run"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["serve", "smollm2", "--max-num-batched-tokens", "0k", "--dry-run"], "--max-num-batched-tokens must be an"),
    # a dtype the stage's engine does not take: refused by --dry-run too (it failed after the master and stages started)
    (["serve", "smollm2", "--dtype", "half", "--dry-run"],
     "--dtype (stage 0 (thinker)): 'half' is not a dtype engine torch_lm takes (bfloat16, float32)"),
    (["serve", "smollm2", "--stage-overrides", '{"0": {"dtype": "auto"}}', "--dry-run"],
     "--stage-overrides: stages[0].engine_args.dtype: 'auto' is not a dtype engine torch_lm takes"),
    (["serve", "smollm2", "--engine-args", '{"threads": true}', "--dry-run"],
     "--engine-args threads must be an integer >= 1, got True"),
    (["serve", "smollm2", "--stage-overrides", '{"0": {"max_num_seqs": -1}}', "--dry-run"],
     "--stage-overrides: stages[0].engine_args.max_num_seqs must be an integer >= 1, got -1"),
    (["master", "--port", "0", "--state-dir", os.devnull], "--state-dir /dev/null: cannot keep"),
    # a headless stage runs no frontend nor master: their flags are refused, not dropped (--dry-run: not
    # refused, it exits 0)
    ([*HEADLESS, "--api-server-count", "2"], "--api-server-count: not with --headless"),
    ([*HEADLESS, "--port", "8000", "--host", "0.0.0.0", "--api-key", "k", "--served-model-name", "a"],
     "--host, --port, --api-key, --served-model-name: not with --headless"),
    ([*HEADLESS, "--state-dir", "/tmp/x", "--control-api-key", "k", "--disable-control-routes"],
     "--control-api-key, --disable-control-routes, --state-dir: not with --headless"),
    ([*HEADLESS, "--max-request-bytes", "2048", "--timeout-keep-alive", "1", "--timeout-request-body", "1",
      "--timeout-response-write", "1", "--backlog", "1"],
     "--max-request-bytes, --timeout-keep-alive, --timeout-request-body, --timeout-response-write, --backlog: not with"),
    (["serve", "smollm2", "--timeout-response-write", "0", "--dry-run"], "--timeout-response-write must be at least 0.1"),
])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    r = omni(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.strip().splitlines() if not line.startswith("omni: warning:")]
    assert len(errors) == 1, r.stderr   # one line (a secret on the command line is also warned about)


def test_help_lists_the_flags():
    r = omni("serve", "--help")
    assert r.returncode == 0
    for flag in ("--stage-id", "--headless", "--omni-master-address", "--omni-master-port",
                 "--deploy-config", "--stage-overrides", "--api-server-count", "--omni-token"):
        assert flag in r.stdout, flag
    r = omni("status", "--help")
    assert r.returncode == 0 and "--json" in r.stdout and "--watch" in r.stdout


def test_secrets_on_the_command_line_are_masked_with_a_warning(capsys):
    from omni.cli import hide_secrets

    argv = ["serve", "m", "--omni-token", "t0k", "--api-key=k3y", "--control-api-key", "adm", "--port", "1"]
    masked = hide_secrets(argv)
    assert masked == ["serve", "m", "--omni-token", "***", "--api-key=***", "--control-api-key", "***",
                      "--port", "1"]
    err = capsys.readouterr().err
    assert "OMNI_TOKEN" in err and "OMNI_API_KEY" in err and "t0k" not in err
    assert hide_secrets(["serve", "m"]) == ["serve", "m"]


def test_an_empty_api_key_in_the_environment_is_refused():
    env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**env, "OMNI_API_KEY": ""})
    assert r.returncode == 2 and "OMNI_API_KEY (the environment's --api-key) is empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("env, named", [
    ({"VLLM_API_KEY": ""}, "VLLM_API_KEY"),                       # was: /v1 open
    ({"OMNI_API_KEY": "", "VLLM_API_KEY": "k"}, "OMNI_API_KEY"),  # was: ['k'], the empty one passed over
    ({"OMNI_API_KEY": "", "VLLM_API_KEY": ""}, "OMNI_API_KEY"),
])
def test_an_empty_key_in_either_variable_is_refused_by_name(env, named, monkeypatch, capsys):
    from omni.cli import main

    for name in ("OMNI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(["serve", "smollm2", "--dry-run"])
    assert e.value.code == 2
    assert f"{named} (the environment's --api-key) is empty" in capsys.readouterr().err


@pytest.fixture
def planned_frontends(monkeypatch) -> list:
    """`omni serve` only plans its children: the frontends it would start (their argv and env) land here."""
    from omni.launcher import Launcher

    frontends = []

    def plan_only(self):
        self._plan_children()
        frontends.extend(c for c in self.children if c.kind == "frontend")
        self.shutdown()
        return 0

    monkeypatch.setattr(Launcher, "run", plan_only)
    return frontends


@pytest.mark.parametrize("env, key", [({"VLLM_API_KEY": "vk"}, "vk"),
                                      ({"VLLM_API_KEY": "vk", "OMNI_API_KEY": "ok"}, "ok")])
def test_vllm_api_key_guards_the_frontends_like_vllm_serve(monkeypatch, planned_frontends, env, key):
    """vllm serve turns auth on from VLLM_API_KEY; a vLLM user's environment must not give an open /v1."""
    from typer.testing import CliRunner

    from omni.cli import app

    for name in ("OMNI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(app, ["serve", "smollm2", "--port", "0"], env=env)
    assert r.exit_code == 0, r.output
    assert planned_frontends and all(json.loads(c.env["OMNI_API_KEYS"]) == [key] for c in planned_frontends)


@pytest.mark.parametrize("flags", [
    ["--served-model-name", "a", "b", "--api-key", "k 1", "k\n2,3", "--port", "0"],
    # a flag given again replaces its values (vLLM's nargs="+"): x and old are gone
    ["--served-model-name", "x", "--served-model-name", "a", "b", "--api-key", "old", "--api-key", "k 1", "k\n2,3",
     "--port", "0"],
    ["--served-model-name=a", "b", "--port", "0", "--api-key=k 1", "k\n2,3"],
])
def test_several_names_and_keys_reach_the_frontends_keys_by_environment_only(monkeypatch, planned_frontends, flags):
    """vLLM's nargs="+": `--served-model-name a b` answers to both (a reported), `--api-key K1 K2`
    accepts either; the keys reach each frontend child as a JSON list in its environment, never argv."""
    from typer.testing import CliRunner

    from omni import children, envs
    from omni.cli import app, spread_several_values

    for name in ("OMNI_API_KEY", "VLLM_API_KEY", "OMNI_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(app, spread_several_values(["serve", "smollm2", *flags]))
    assert r.exit_code == 0, r.output
    assert len(planned_frontends) == 1
    child = planned_frontends[0]
    assert child.argv[1:3] == ["-m", "omni.children"]
    assert children.parser().parse_args(child.argv[3:]).served_model_name == ["a", "b"]
    assert not any("k 1" in a or "k\n2" in a for a in child.argv)
    monkeypatch.setenv("OMNI_API_KEYS", child.env["OMNI_API_KEYS"])
    assert envs.OMNI_API_KEYS == ["k 1", "k\n2,3"]   # what children.main hands the frontend


def test_several_values_spread_up_to_the_next_flag_without_taking_model():
    from omni.cli import spread_several_values

    assert spread_several_values(["serve", "m", "--api-key", "k1", "k2", "--port", "0", "--served-model-name", "a"]) == \
        ["serve", "m", "--api-key", "k1", "--api-key", "k2", "--port", "0", "--served-model-name", "a"]
    assert spread_several_values(["serve", "m", "--api-key", "-k1", "k2"]) == \
        ["serve", "m", "--api-key", "-k1", "--api-key", "k2"]   # the first value is taken whatever it is
    # MODEL not right after `serve`: a bare word may be MODEL, so each flag keeps its one value.
    argv = ["serve", "--served-model-name", "a", "m"]
    assert spread_several_values(argv) == argv


def test_several_keys_on_the_command_line_are_all_masked(capsys):
    from omni.cli import hide_secrets, spread_several_values

    masked = hide_secrets(spread_several_values(["serve", "m", "--api-key", "k1", "k2", "--port", "1"]))
    assert masked == ["serve", "m", "--api-key", "***", "--api-key", "***", "--port", "1"]
    assert capsys.readouterr().err.count("warning") == 1


def test_several_names_and_keys_pass_the_command_line():
    r = omni("serve", "smollm2", "--served-model-name", "a", "b", "--api-key", "k1", "k2", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "k1" not in r.stdout + r.stderr and "k2" not in r.stdout + r.stderr


PLAN = """
import sys
import omni.launcher as launcher
class Launcher:
    def __init__(self, plan):
        print(repr((plan.api_keys, plan.served_model_names)))
    def run(self):
        return 0
launcher.Launcher = Launcher
from omni import cli
cli.main(sys.argv[1:])
"""


def planned_keys_and_names(*args: str) -> tuple[list[str], list[str]]:
    """The API keys and model names `omni serve ARGS` would hand its frontends (the launcher stubbed)."""
    r = subprocess.run([sys.executable, "-c", PLAN, "serve", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k not in ("OMNI_API_KEY", "VLLM_API_KEY")})
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])   # noqa: S307 (our own repr)


@pytest.mark.parametrize("args", [
    ["smollm2", "--api-key", "OLD", "--served-model-name", "old", "--api-key", "NEW", "--served-model-name", "new"],
    ["smollm2", "--api-key", "OLD", "O2", "--served-model-name", "old", "o2", "--api-key", "NEW",
     "--served-model-name=new"],
    # flags before MODEL take one value each; the last occurrence still wins
    ["--api-key", "OLD", "--served-model-name", "old", "smollm2", "--api-key", "NEW", "--served-model-name", "new"],
    ["--api-key=OLD", "--port", "0", "--served-model-name", "old", "--api-key", "NEW", "--served-model-name", "new",
     "smollm2"],
])
def test_a_repeated_several_value_flag_keeps_its_last_values_only(args):
    """vLLM's nargs="+" keeps the last --api-key's keys: a key replaced on the command line must stop working."""
    assert planned_keys_and_names(*args) == (["NEW"], ["new"])


def test_flags_before_model_still_spread_the_values_after_it():
    assert planned_keys_and_names("--disable-control-routes", "--port", "0", "smollm2", "--api-key", "K1", "K2",
                                  "--served-model-name", "a", "b")[0] == ["K1", "K2"]
    from omni.cli import spread_several_values

    assert spread_several_values(["serve", "--dry-run", "--port", "0", "m", "--api-key", "k1", "k2"]) == \
        ["serve", "--dry-run", "--port", "0", "m", "--api-key", "k1", "--api-key", "k2"]
    assert spread_several_values(["serve", "-oma", "h", "--api-key", "k0", "m", "--api-key", "k1", "k2"]) == \
        ["serve", "-oma", "h", "m", "--api-key", "k1", "--api-key", "k2"]
    argv = ["serve", "m", "--", "--api-key", "k1", "k2"]    # after `--`: left to typer
    assert spread_several_values(argv) == argv


def test_keys_before_model_spread_and_are_never_echoed():
    """`serve --dry-run MODEL --api-key K1 K2` failed with "unexpected argument 'K2'", a key on stderr."""
    r = omni("serve", "--dry-run", "smollm2", "--api-key", "K1zq", "K2zq")
    assert r.returncode == 0, r.stderr
    assert "zq" not in r.stdout + r.stderr


@pytest.mark.parametrize("args, message", [
    (["smollm2", "--control-api-key", "K1zq", "K2zq"], "--control-api-key takes one value"),
    (["smollm2", "--omni-token=K1zq", "K2zq"], "--omni-token takes one value"),
    (["--api-key", "K1zq", "K2zq", "K3zq", "smollm2"], "put MODEL right after `serve`: omni serve MODEL"),
    (["--api-key", "K1zq", "K2zq"], "no bundled deploy config for model '***'"),   # K2 taken as MODEL
])
def test_a_word_after_a_secret_flag_is_never_echoed(args, message):
    r = omni("serve", *args, "--dry-run")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "zq" not in r.stdout + r.stderr


def test_headless_takes_the_head_flags_from_the_environment_and_their_defaults():
    """Only a head-only flag typed on the command line is refused: OMNI_CONTROL_API_KEY set for the host's
    other commands, and the flags' defaults, are no error."""
    r = subprocess.run([sys.executable, "-m", "omni.cli", *HEADLESS], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "OMNI_CONTROL_API_KEY": "k"})
    assert r.returncode == 0, r.stderr
    r = omni("serve", "smollm2", "--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", "1",
             "--port", "0", "--api-server-count", "2", "--state-dir", "/tmp/omni-unused-state", "--dry-run")
    assert r.returncode == 0, r.stderr      # the head takes them
    assert not os.path.exists("/tmp/omni-unused-state")   # a dry run creates nothing
