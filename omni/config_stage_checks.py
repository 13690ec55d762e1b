"""Checks of a deploy stage's `devices`, `connectors` and `engine_args` that would otherwise be
taken and do nothing (omni/config.py calls them while it validates the stages).

- `devices`: vllm-omni's forms, "cpu" or GPU indices into the visible devices ("0", "0,1", or
  a YAML integer 0), become the stage's CUDA_VISIBLE_DEVICES (omni.stage.main.select_devices);
  "cuda:0,cuda:1" is read as "0,1", `null` (vllm-omni's default) as "": every visible GPU,
  CUDA_VISIBLE_DEVICES left as it is. Anything else (a negative or non-integer index, a GPU named
  twice) is refused at load, before any process starts: "cuda:0" used to become
  CUDA_VISIBLE_DEVICES=cuda:0, which hides every GPU.
- `connectors`: keyed by the stage that reads this stage's output (its `inputs` name this stage);
  the orchestrator looks up no other key, so one to the stage itself, an earlier stage or a stage
  that does not read this one is refused, naming the pipeline's edges.
- `engine_args`: EngineArgs fields only vLLM's serving layer reads (omni's frontend tokenizes,
  samples and names the model itself) are refused as `omni serve --tokenizer` ... are
  (omni.vllm_serve_flags): a vllm stage would take them and change nothing.
  `subtalker_sampling_params` (vllm-omni's: the code predictor's do_sample / temperature / top_k /
  top_p) is taken by the engines that have Qwen3's code predictor and refused on any other.
- `env` (vllm-omni's): variable -> text, set in the stage's process before its engine loads
  (omni.stage.main.run_stage; the launcher starts the process with it too). Numbers become text; a
  boolean, null or nested value is refused (write the text the variable expects), and so are the
  variables omni sets itself (CUDA_VISIBLE_DEVICES: use `devices`) or that hold its secrets: the
  resolved config, env included, reaches every process and the master (`--dry-run` and a replica's
  config-mismatch refusal show the variables' names only, omni/cli.py and omni/master/configdiff.py).
- `engine_args` that vLLM reads as human-readable integers (HUMAN_INTS: max_num_batched_tokens: 8k) become
  numbers at load, as `vllm serve` reads them: 8k is 8000, 8K 8192; a value that is none is refused naming
  its key (the engine got the text and failed at start).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from omni import mm_limits
from omni.config_checks import SAMPLING_RANGES
from omni.digits import ascii_int
from omni.errors import ConfigError

__all__ = ["COUNT_ARGS", "DTYPE_CHOICES", "FRAME_ARGS", "HUMAN_INTS", "RESERVED_ENV", "SERVING_ONLY_ARGS", "SUBTALKER",
           "SUBTALKER_ENGINES", "blame_override", "check_connector_edge", "check_counts", "check_dtype",
           "check_engine_args", "check_stage_override", "check_subtalker", "human_int", "is_count", "normalise_devices",
           "normalise_env", "normalise_human_ints", "normalise_stages", "unused_engine_arg"]

DEVICE_FORMS = "'cpu' or GPU indices into the visible GPUs: \"0\", \"0,1\" (or \"cuda:0,cuda:1\")"

_REVISION = "omni loads MODEL as it is on disk: serve a folder holding the revision you want"
_NO_FETCH = "omni fetches no URL: send input_audio or data: URLs"
_GENERATION = "omni's sampling defaults are each stage's default_sampling_params in the deploy YAML"
# EngineArgs fields only vLLM's serving layer reads: refused as engine args and as `omni serve` flags.
SERVING_ONLY_ARGS = {
    "tokenizer": "omni's frontend tokenizes with MODEL's own tokenizer and the stages take token ids; "
                 "another tokenizer is not supported",
    "tokenizer_revision": _REVISION,
    "revision": _REVISION,
    "code_revision": _REVISION,
    "generation_config": _GENERATION,
    "override_generation_config": _GENERATION,
    # vLLM's chat parser reads them as it loads a message's media; omni's frontend decodes the parts itself
    **dict.fromkeys(("allowed_media_domains", "allowed_local_media_path"), _NO_FETCH),
    "media_io_kwargs": f"{_NO_FETCH}; it decodes WAV audio itself and takes no media loading arguments",
    "interleave_mm_strings": "omni's frontend hands each audio part to the chat template where it stands in the "
                             "message",
    # read by vLLM's engine too: with image/video limits 0 it keeps encoder room for their embeddings
    "enable_mm_embeds": "omni's chat takes no image_embeds / audio_embeds parts (a 400 naming the part's type): "
                        "send input_audio or data: URLs",
    # the engine keeps it, but its profiler starts only at vLLM's POST /start_profile
    "profiler_config": "omni has no /start_profile or /stop_profile route to run vLLM's profiler with",
}
# Engine args only: `omni serve` has the flag of its own.
_ENGINE_ARGS_ONLY = {"served_model_name": "the API's model name is `omni serve --served-model-name`",
                     # lifted out of engine_args wherever omni reads them (config_vllm_omni.lift_chunk)
                     "async_chunk": "it is the stage's own key (stages[i].async_chunk) or `omni serve "
                                    "--async-chunk / --no-async-chunk`",
                     # omni stops a stage's engine itself, after the frontends drained what it serves
                     "shutdown_timeout": "a stop's drain is `omni serve --shutdown-timeout` (the API frontends')"}
# vllm-omni's sampling of Qwen3's code predictor (the 15 residual codes of a frame), and the engines that have one
# (tests/unit/test_config_stage_keys.py checks this against the engines' own arguments).
SUBTALKER = "subtalker_sampling_params"
SUBTALKER_KEYS = ("do_sample", "temperature", "top_k", "top_p")
SUBTALKER_ENGINES = ("qwen3_talker",)
# Engine args in frames, >= 1 (Qwen3's code2wav re-decodes the tail a chunk holds back from >= 1 frame of context).
FRAME_ARGS = {"qwen3_code2wav": ("first_chunk_frames", "chunk_frames", "context_frames")}
# The dtypes each engine takes (torch_lm: its own two; vLLM: its --dtype choices; omni's torch engines: torch's
# names, "auto" where they read the checkpoint's); checked at load, so --dry-run refuses `--dtype half` on torch_lm.
_TORCH_DTYPES = ("float32", "float", "bfloat16", "float16", "half")
DTYPE_CHOICES = {"torch_lm": ("bfloat16", "float32"), "vllm": ("auto", *_TORCH_DTYPES),
                 "qwen_image": _TORCH_DTYPES, "wan": _TORCH_DTYPES,
                 **dict.fromkeys(("qwen3_talker", "qwen3_code2wav", "qwen25_talker"), ("auto", *_TORCH_DTYPES))}
# Counts every engine that takes them needs at >= 1, checked at load (and so by --dry-run): an engine
# refused 0 only when its stage started, after the master and the other stages had.
COUNT_ARGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_threads", "threads", "max_batch_rows",
              "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
_SECRET = ("it holds a secret, and the resolved config, env included, reaches every process and the master; "
           "`omni serve` passes it to the processes that need it")
# Variables a stage's `env` may not set: omni sets them itself, or they hold its secrets (omni/envs.py).
RESERVED_ENV = {
    "CUDA_VISIBLE_DEVICES": "omni sets it from the stage's `devices` (GPU indices into the visible GPUs): "
                            "use `devices`",
    **{k: _SECRET for k in ("OMNI_TOKEN", "OMNI_API_KEY", "OMNI_API_KEYS", "OMNI_CONTROL_API_KEY", "VLLM_API_KEY")},
    "OMNI_DIE_WITH_PARENT": "omni sets it while it starts processes that must die with it (omni/deathsig.py)",
    # a stage reloads the deploy in its own process: these would resolve another config than the head's
    "OMNI_PLATFORM": "it picks the deploy's platform section, which every process must resolve alike; set it "
                     "for `omni serve` (the head and each --headless stage) instead",
    "OMNI_CACHE_DIR": "it locates the models omni builds or fetches for MODEL, which every process must "
                      "resolve alike; set it for `omni serve` instead",
}


# EngineArgs fields vLLM parses with its human_readable_int (vllm/engine/arg_utils.py), and max_model_len,
# which it reads the same way (auto aside).
HUMAN_INTS = ("max_num_batched_tokens", "max_num_scheduled_tokens", "max_num_queued_tokens", "kv_cache_memory_bytes",
              "safetensors_prefetch_block_size", "max_model_len")
HUMAN_INT_FORMS = "an integer: 8192, 8k (8000), 8K (8192), 1.5m (1500000); k/m/g/t are powers of 1000, K/M/G/T of 1024"
_HUMAN_INT = re.compile(r"(\d+)([KMGT]?)|(\d+(?:\.\d+)?)([kmgt])")
_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_int(text: str) -> int | None:
    """vLLM's human-readable integer (2048, 25.6k, 8K) as a number; None: not one (1.5K has no whole number
    of KiB, so vLLM refuses it too)."""
    m = _HUMAN_INT.fullmatch(text.strip())
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)) * _BINARY[m.group(2)]
    return int(float(m.group(3)) * _DECIMAL[m.group(4)])   # float, as vLLM: the same number for the same text


def normalise_human_ints(args: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """`args` with the HUMAN_INTS given as text turned into numbers; a value that is no integer is refused,
    `name(key)` naming it (the flag, or the YAML key path)."""
    out = dict(args)
    for key in HUMAN_INTS:
        value = out.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            continue
        n = human_int(value) if isinstance(value, str) else None
        if n is None:
            raise ConfigError(f"{name(key)}: {value!r} is not {HUMAN_INT_FORMS}")
        out[key] = n
    return out


def normalise_devices(value: Any, where: str) -> str:
    """A stage's `devices` as omni keeps it: "cpu", or GPU indices "0,1" (or "", unrestricted: vllm-omni's
    `devices: null`, the default visibility)."""
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        tokens = [str(value)]
    elif isinstance(value, str):
        if value.strip().lower() == "cpu" or not value.strip():
            return value.strip().lower()
        tokens = [t.strip() for t in value.split(",") if t.strip()]
    else:
        raise ConfigError(f"{where}.devices must be {DEVICE_FORMS}, got {value!r}")
    out: list[str] = []
    for token in tokens:
        index = token[5:] if token.lower().startswith("cuda:") else token
        gpu = ascii_int(index)
        if gpu is None:
            raise ConfigError(f"{where}.devices: {token!r} in {value!r} is not a GPU index (a non-negative "
                              f"integer); devices must be {DEVICE_FORMS}")
        if str(gpu) in out:
            raise ConfigError(f"{where}.devices: {value!r} names GPU {gpu} twice")
        out.append(str(gpu))
    if not out:
        raise ConfigError(f"{where}.devices must be {DEVICE_FORMS}, got {value!r}")
    return ",".join(out)


def normalise_env(value: Any, where: str) -> dict[str, str]:
    """A stage's `env` as omni keeps it: variable -> text (values are never echoed: they may be secret)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}.env must be a mapping of variable -> value, got {type(value).__name__}")
    out: dict[str, str] = {}
    for key, v in value.items():
        here = f"{where}.env.{key}"
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ConfigError(f"{here}: not a variable name (a non-empty string without '=')")
        if key in RESERVED_ENV:
            raise ConfigError(f"{here}: not supported: {RESERVED_ENV[key]}")
        if isinstance(v, (dict, list)):
            raise ConfigError(f"{here} must be text or a number, got a {'mapping' if isinstance(v, dict) else 'list'}")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{here} must be text or a number, got {'null' if v is None else type(v).__name__} "
                              "(write the text the variable expects, quoted: \"1\", \"true\" ...)")
        if "\0" in str(v):
            raise ConfigError(f"{here}: a value cannot hold a NUL character")
        out[key] = str(v)
    return out


def normalise_stages(data: dict[str, Any], source: str) -> None:
    """Every stage's `devices`, `env` and human-readable engine_args in a merged deploy mapping, normalised
    (before typing): `data` gets a new `stages` list, the caller's stage mappings stay as they were."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return
    data["stages"] = [dict(s) if isinstance(s, dict) else s for s in stages]
    for i, stage in enumerate(data["stages"]):
        if not isinstance(stage, dict):
            continue
        where = f"{source}: stages[{stage.get('stage_id', i)}]"
        if "devices" in stage:
            stage["devices"] = normalise_devices(stage["devices"], where)
        if "env" in stage:
            stage["env"] = normalise_env(stage["env"], where)
        if isinstance(stage.get("engine_args"), dict):
            stage["engine_args"] = normalise_human_ints(stage["engine_args"], lambda k, w=where: f"{w}.engine_args.{k}")


def check_connector_edge(config: Any, stage: Any, edge: str, where: str) -> None:
    """`connectors.<edge>` of `stage` must name a stage that reads its output."""
    target = int(edge)
    if target in config.downstream(stage.stage_id):
        return
    if target == stage.stage_id:
        why = "a stage has no edge to itself"
    elif target < stage.stage_id:
        why = f"stage {target} comes before stage {stage.stage_id} (edges run to later stages)"
    else:
        reads = list(config.stage(target).inputs)
        why = f"stage {target} does not read stage {stage.stage_id}'s output (its inputs: {reads})"
    edges = [f"{s.stage_id}->{t}" for s in config.stages for t in config.downstream(s.stage_id)]
    mine = [f"'{t}'" for t in config.downstream(stage.stage_id)]
    raise ConfigError(f"{where}.connectors.{edge}: not an edge of the pipeline: {why}; a connector is keyed by a "
                      f"stage whose inputs name this one ({', '.join(mine) or 'none reads this stage'}); the "
                      f"pipeline's edges: {', '.join(edges) or 'none'}")


def unused_engine_arg(args: dict[str, Any]) -> str | None:
    """"KEY: not supported: why" for the first engine arg no stage's engine would act on; None: none."""
    for key, why in {**SERVING_ONLY_ARGS, **_ENGINE_ARGS_ONLY}.items():
        if key in args:
            return f"{key}: not supported: {why}"
    return None


def check_engine_args(args: dict[str, Any], engine: str, where: str) -> None:
    """A stage's engine_args (`where`: their key path) no engine would act on, or `engine` would not, refused;
    so are frame counts its engine would refuse only at the stage's start (FRAME_ARGS)."""
    unused = unused_engine_arg(args)
    if unused:
        raise ConfigError(f"{where}.{unused}")
    for key in FRAME_ARGS.get(engine, ()):
        value = args.get(key, 1)
        if not is_count(value):
            raise ConfigError(f"{where}.{key} must be a number of frames >= 1, got {value!r}")
    check_counts(args, lambda k: f"{where}.{k}")
    mm_limits.check(args, lambda k: f"{where}.{k}")
    check_dtype(args.get("dtype"), engine, f"{where}.dtype")
    if SUBTALKER in args:
        if engine not in SUBTALKER_ENGINES:
            raise ConfigError(f"{where}.{SUBTALKER}: not supported by engine {engine}: it samples Qwen3-Omni's code "
                              f"predictor (a frame's residual codes), which only {', '.join(SUBTALKER_ENGINES)} has")
        check_subtalker(args[SUBTALKER], f"{where}.{SUBTALKER}")


def check_dtype(value: Any, engine: str, name: str) -> None:
    """`value` as the dtype of an `engine` stage (DTYPE_CHOICES; other engines: their own check); `name` names it."""
    choices = DTYPE_CHOICES.get(engine)
    if value is not None and choices is not None and value not in choices:
        raise ConfigError(f"{name}: {value!r} is not a dtype engine {engine} takes ({', '.join(choices)})")


def is_count(value: Any) -> bool:
    """An integer >= 1 (YAML's true is a bool, no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_counts(args: dict[str, Any], name: Callable[[str], str]) -> None:
    """COUNT_ARGS in `args` at >= 1; `name(key)` names a refused one (the flag, or the YAML key path)."""
    for key in COUNT_ARGS:
        value = args.get(key)
        n = human_int(value) if isinstance(value, str) and key in HUMAN_INTS else value
        if value is not None and not is_count(n):
            raise ConfigError(f"{name(key)} must be an integer >= 1, got {value!r}")


def check_stage_override(stage: dict[str, Any], patch: dict[str, Any], fields: set[str], where: str) -> None:
    """--stage-overrides' `patch` of one stage (`stage`: as patched; `fields`: the stage fields) checked as given,
    so that a refusal names the flag (`where`), not the deploy YAML it patched."""
    if "devices" in patch:
        normalise_devices(patch["devices"], where)
    if "env" in patch:
        normalise_env(patch["env"], where)
    nested = patch.get("engine_args")
    args = {**{k: v for k, v in patch.items() if k not in fields}, **(nested if isinstance(nested, dict) else {})}
    check_engine_args(args, str(stage.get("engine")), f"{where}.engine_args")


def blame_override(error: ConfigError, source: str, stages: list) -> ConfigError:
    """`error`, a refusal of the deploy as --stage-overrides patched it where the deploy alone passes, named by
    the flag and the key path (stages[ID].key), not the YAML it patched (`source`); `stages`: the patched list."""
    text = str(error).removeprefix(f"{source}: ")
    found = re.fullmatch(r"(.*) - at `(.*)`", text, re.DOTALL)    # msgspec's, as config._yaml_path shows it
    if found:
        what, path = found.groups()
        unknown = re.fullmatch(r"Object contains unknown field `(.*)`", what, re.DOTALL)
        if unknown:
            what, path = "unknown field", f"{path}.{unknown[1]}"
        at = re.match(r"stages\[(\d+)\]", path)
        if at and int(at[1]) < len(stages) and isinstance(stages[int(at[1])], dict):   # index -> stage id
            path = f"stages[{stages[int(at[1])].get('stage_id')}]{path[at.end():]}"
        text = f"{path}: {what}"
    return ConfigError(f"--stage-overrides: {text}")


def check_subtalker(value: Any, where: str) -> dict[str, Any]:
    """vllm-omni's subtalker_sampling_params, checked as a request's sampling is; -> the keys set (null: unset)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of {' / '.join(SUBTALKER_KEYS)}, got {value!r}")
    for key, v in value.items():
        if key not in SUBTALKER_KEYS:
            raise ConfigError(f"{where}.{key}: not supported (the code predictor takes {', '.join(SUBTALKER_KEYS)}, "
                              "as vllm-omni's)")
        if v is None:
            continue
        if key == "do_sample":
            if not isinstance(v, bool):
                raise ConfigError(f"{where}.do_sample must be true or false, got {v!r}")
            continue
        number = isinstance(v, int) if key == "top_k" else isinstance(v, (int, float))
        ok, wanted = SAMPLING_RANGES[key]
        if isinstance(v, bool) or not number or not ok(v):
            raise ConfigError(f"{where}.{key} must be {'an integer ' if key == 'top_k' else ''}{wanted}, got {v!r}")
    return {k: v for k, v in value.items() if v is not None}
