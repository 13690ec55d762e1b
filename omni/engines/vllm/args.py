"""A vLLM stage's engine args: which are vLLM's and which omni's, the environment its EngineCore
inherits, the sampling mapping, and the vLLM config they make (split from engine.py)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import os
from typing import Any

from omni.engines.base import SamplingParams
from omni.errors import ConfigError

# Engine args omni itself understands (not vLLM's): CPU threads of the EngineCore.
# mm_hidden_layer: capture hidden_states[k] at multi-modal prompt positions ("talker": the
# model's talker_config.accept_hidden_layer), delivered as mm_hidden with the first output.
# emit_prompt_ids: every request's first output carries its prompt ids (as a request's emit_prompt_ids does).
# hidden_rows_layer: every fed token's rows at layer k ("last": before the final norm) for audio_out requests.
OMNI_ARGS = ("num_threads", "mm_hidden_layer", "emit_prompt_ids", "hidden_rows_layer")
# Env defaults for the EngineCore (read by vLLM at import and in its children).
# Loopback for vLLM's own sockets: the EngineCore always sits next to its stage.
ENV_DEFAULTS = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# A unix socket's path holds at most 107 bytes (sun_path, its NUL aside).
IPC_PATH_MAX = 107
# Only on CPU: a fixed KV cache (else start-up fails a memory check) and no warm-up pass.
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1"}

def engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


@functools.cache
def engine_arg_fields() -> dict[str, str]:
    """EngineArgs' fields -> their annotations as written, read from vLLM's source without importing it
    (importing vllm.engine.arg_utils takes 10-20 s on a few shared cores; config load checks the keys and
    the extra flags' types); {}: no vLLM installed. tests/unit/test_engine_arg_checks.py compares it with
    engine_arg_names()."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return {}
    path = os.path.join(os.path.dirname(spec.origin), "engine", "arg_utils.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return {b.target.id: ast.unparse(b.annotation) for b in node.body
                    if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
    return {}


def split_engine_args(label: str, args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vLLM EngineArgs kwargs, omni's own args); unknown keys are a ConfigError naming them."""
    known = engine_arg_names()
    unknown = sorted(k for k in args if k not in known and k not in OMNI_ARGS)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, sorted(known | set(OMNI_ARGS)), n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{label}: engine 'vllm' does not take engine_args " + ", ".join(hints) +
                          "; it takes vLLM's EngineArgs fields (vllm.engine.arg_utils.EngineArgs) "
                          "and " + ", ".join(OMNI_ARGS))
    for k in ("model", "skip_tokenizer_init"):
        if k in args:
            raise ConfigError(f"{label}: engine_args.{k} is set by omni (the stage's model; "
                              "tokenization stays in the frontends); remove it")
    vllm_args = {k: v for k, v in args.items() if k not in OMNI_ARGS}
    omni_args = {k: v for k, v in args.items() if k in OMNI_ARGS}
    return vllm_args, omni_args


def prepare_env(num_threads: int | None, cpu: bool, kv_bytes_given: bool = False) -> str | None:
    """Environment the EngineCore process inherits; user-set values win. Returns the folder made for
    vLLM's ipc sockets (None: the user chose one), which the engine removes at shutdown, and the stage's
    exit (fsutil.remove_registered) where the engine never got that far."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    rpc_dir = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        # vLLM's ZMQ ipc sockets go to the temp dir, and 7 a stage start stayed there after a clean
        # stop (its processes end without closing them): a folder of this stage's own instead.
        import shutil

        from omni.fsutil import owned_tmp_dir, remove_on_exit

        rpc_dir = owned_tmp_dir()
        if len(rpc_dir) + 1 + 36 > IPC_PATH_MAX:   # vLLM names a socket DIR/<uuid4>: a long TMPDIR's won't bind
            shutil.rmtree(rpc_dir, ignore_errors=True)
            rpc_dir = None
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir
            remove_on_exit(rpc_dir)   # a stop or failure mid-load never reaches the engine's shutdown
    if not cpu:
        return rpc_dir
    for k, v in CPU_ENV_DEFAULTS.items():
        # On CPU, VLLM_CPU_KVCACHE_SPACE would override an explicit kv_cache_memory_bytes.
        if not (k == "VLLM_CPU_KVCACHE_SPACE" and kv_bytes_given):
            os.environ.setdefault(k, v)
    if num_threads is not None:
        # vLLM's CPU worker binds its OpenMP threads to whole NUMA nodes by default;
        # on a shared host a stage gets exactly the threads it was given instead.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["OMP_NUM_THREADS"] = str(int(num_threads))
    return rpc_dir


def to_vllm_sampling(p: SamplingParams):
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    return VSP(
        n=1,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,            # 0: off, in both
        seed=p.seed,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias) or None,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs,       # vLLM's default logprobs_mode: raw, as the torch engine's
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )


def engine_config(label: str, model_path: str, vllm_args: dict[str, Any], skip_tokenizer: bool):
    from vllm.engine.arg_utils import EngineArgs

    try:
        engine_args = EngineArgs(model=model_path, skip_tokenizer_init=skip_tokenizer, **vllm_args)
    except TypeError as e:
        raise ConfigError(f"{label}: vLLM engine_args: {e}") from None
    try:
        return engine_args, engine_args.create_engine_config()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{label}: vLLM refused the engine args: {e}") from None
