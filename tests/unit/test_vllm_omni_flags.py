"""vllm-omni's own `serve` options (its OmniConfig group) on `omni serve`: what each becomes, or why not."""

import json
import os
import subprocess
import sys

import pytest

from omni import vllm_omni_flags as vf
from omni.errors import ConfigError
from tests.e2e.harness import REPO


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", *args, "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_timeouts_and_the_heartbeat_become_omnis_settings():
    flags = {"stage_init_timeout": 300, "init_timeout": 900, "omni_heartbeat_timeout": 2.5,
             "omni_lb_policy": "least-queue-length", "worker_backend": "multi_process", "max_model_len": 512}
    o = vf.take(flags)
    assert (o.startup_timeout_s, o.lease_ttl_s) == (900.0, 2.5)      # the whole start-up's bound wins
    assert flags == {"max_model_len": 512}                           # engine flags stay for the stages
    assert vf.take({"stage_init_timeout": 120}).startup_timeout_s == 120.0
    assert vf.take({}) == vf.Orchestration()


@pytest.mark.parametrize("flags, message", [
    ({"omni_heartbeat_timeout": 0}, "--omni-heartbeat-timeout: expected a number of seconds > 0, got 0"),
    ({"init_timeout": "soon"}, "--init-timeout: expected a number of seconds > 0, got 'soon'"),
    ({"omni_lb_policy": "round-robin"}, "--omni-lb-policy round-robin: omni routes each request to the least loaded"),
    ({"worker_backend": "ray"}, "--worker-backend ray: omni runs without Ray"),
    ({"ray_address": "10.0.0.1:6379"}, "--ray-address: omni runs without Ray"),
])
def test_what_omni_does_not_offer_is_refused_by_name(flags, message):
    with pytest.raises(ConfigError) as e:
        vf.take(flags)
    assert message in str(e.value)


def test_the_cli_passes_them_on_and_names_the_no_ops():
    r = serve("--omni", "--init-timeout", "900", "--omni-heartbeat-timeout", "2.5", "--log-stats",
              "--replica-id", "3", "--enable-sleep-mode")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["orchestration"] == {"startup_timeout_s": 900.0, "lease_ttl_s": 2.5}
    assert "--log-stats: ignored: omni's figures are always on /metrics" in r.stderr
    assert "--replica-id: ignored: deprecated in vllm-omni too" in r.stderr
    assert "--enable-sleep-mode: no stage of this pipeline takes it" in r.stderr and "ignored" in r.stderr


@pytest.mark.parametrize("flag, message", [
    (["--vae-use-tiling"], "--vae-use-tiling: vllm-omni's diffusion option, not supported"),
    (["--task-type", "Base"], "--task-type: vllm-omni's speech option, not supported"),
    (["--log-file", "/tmp/x.log"], "--log-file: vllm-omni's orchestrator option, not supported: omni's processes log"),
    (["--no-guardrails"], "--no-guardrails: vllm-omni's orchestrator option"),
    # spellings other than the argparse dest: a short form, a store_false flag, a --no- form
    (["-dac", "{}"], "--diffusion-attention-config: vllm-omni's diffusion option, not supported"),
    (["--disable-multithread-weight-load"], "--disable-multithread-weight-load: vllm-omni's diffusion option"),
    (["--dlo-no-use-allgather"], "--dlo-no-use-allgather: vllm-omni's diffusion option"),
    (["--no-diffusion-compile-dynamic"], "--no-diffusion-compile-dynamic: vllm-omni's diffusion option"),
])
def test_other_vllm_omni_options_are_named_as_vllm_omnis(flag, message):
    r = serve(*flag)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("key, value, flag", [
    ("disable_multithread_weight_load", True, "--disable-multithread-weight-load"),
    ("dlo_no_use_allgather", True, "--dlo-no-use-allgather"), ("dlo_use_allgather", True, "--dlo-use-allgather"),
    ("ulysses_a2a_permute", False, "--no-ulysses-a2a-permute"), ("ulysses_a2a_permute", True, "--ulysses-a2a-permute"),
    ("usp", 2, "--usp"), ("ring", 2, "--ring"), ("guardrails", False, "--no-guardrails"),
])
def test_each_spelling_of_a_vllm_omni_option_is_named_as_typed(key, value, flag):
    """vllm-omni's option strings, not its argparse dests: --disable-multithread-weight-load (dest
    enable_multithread_weight_load) and --dlo-no-use-allgather were 'no stage of this pipeline takes it'."""
    assert vf.refusal(key, value).startswith(f"{flag}: vllm-omni's ")
    assert vf.refusal("enable_multithread_weight_load", True) is None     # a dest, no flag of vllm-omni's


def test_the_short_master_flags():
    r = subprocess.run([sys.executable, "-m", "omni.cli", "serve", "smollm2", "--stage-id", "1", "--headless",
                        "-oma", "10.1.2.3", "-omp", "26000", "-ora", "10.1.2.4", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMNI_TOKEN": "t0k"})   # a stage beyond loopback needs a token (63e8e57)
    assert r.returncode == 0, r.stderr
