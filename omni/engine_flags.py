"""vLLM-style engine flags on `omni serve` (--max-model-len, -tp, --trust-remote-code, any
EngineArgs field as --some-field VALUE): parsed from the command line and, in single-command
mode, spread over the stages whose engine takes them.

They are read as `vllm serve` reads them: its short forms (-q, -pp, -O3, -cc.mode, -asc; SHORT_FLAGS,
spelled out before typer parses the argv), dotted keys of a JSON flag (--compilation-config.mode 0
is {"mode": 0}), human-readable integers (--max-num-batched-tokens 8k is 8000, 8K 8192)."""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any

from omni import vllm_omni_flags
from omni.cli_argv import merge_into
from omni.config_stage_checks import human_int, normalise_human_ints
from omni.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from omni.config import DeployConfig, StageConfig

# vLLM's short forms of engine flags (vllm/engine/arg_utils.py; tests/unit/test_engine_flags.py checks
# them against vLLM's parser). -O is its own: -O3, -O=3, -O 3 are --optimization-level 3.
SHORT_FLAGS = {"-q": "--quantization", "-pp": "--pipeline-parallel-size", "-tp": "--tensor-parallel-size",
               "-n": "--nnodes", "-r": "--node-rank", "-dcp": "--decode-context-parallel-size",
               "-pcp": "--prefill-context-parallel-size", "-dp": "--data-parallel-size",
               "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank",
               "-dpl": "--data-parallel-size-local", "-dpa": "--data-parallel-address",
               "-dpp": "--data-parallel-rpc-port", "-dpb": "--data-parallel-backend",
               "-dph": "--data-parallel-hybrid-lb", "-dpe": "--data-parallel-external-lb",
               "-dpm": "--data-parallel-multi-port-external-lb", "-ep": "--enable-expert-parallel",
               "-sc": "--speculative-config", "-dc": "--diffusion-config", "-cc": "--compilation-config",
               "-ac": "--attention-config"}
# vLLM serve's own short forms (vllm/entrypoints/launchers/cli_args.py), checked against its serve parser.
SERVE_SHORT_FLAGS = {"-asc": "--api-server-count"}
# Engine flags that take several values (vLLM's nargs="+": `--cudagraph-capture-sizes 1 2 4`, a list even with
# one value), and vllm-omni's --lora-path; tests/unit/test_engine_flags.py checks them against vLLM's serve
# parser (read here from a table: importing vLLM's parser costs seconds, and omni serve runs without vLLM).
# --api-key and --served-model-name are serve's own (omni.cli_argv.SEVERAL_VALUES).
SEVERAL_VALUES = frozenset({
    "allowed_media_domains", "sleep_preserve_parameter_names", "logits_processors", "ignore_patterns",
    "numa_bind_nodes", "numa_bind_cpus", "kv_cache_dtype_skip_layers", "cpu_offload_params", "offload_params",
    "lora_target_modules", "collect_detailed_traces", "cudagraph_capture_sizes", "lora_modules", "lora_path"})


def spell_out(argv: list[str], more: dict[str, str] | None = None) -> list[str]:
    """`-q fp8 -cc.mode 0 -O3` -> `--quantization fp8 --compilation-config.mode 0 --optimization-level 3`
    (before typer: as short options, -dph would be read as -d -p -h, which is --help). `more`: other
    short forms (vllm-omni's -oma ...). Up to `--` only. The value of a serve option that takes one is
    kept as given: `--api-key -q` is the key "-q", not --quantization."""
    from omni.cli_argv import _VALUE_PREFIXES, _serve_options   # the options typer reads a value for

    takes = _serve_options()[0]
    table = {**SHORT_FLAGS, **SERVE_SHORT_FLAGS, **(more or {})}
    out: list[str] = []
    value_next = False
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if value_next:
            out.append(arg)
            value_next = False
            continue
        value_next = table.get(arg, arg) in takes or arg.startswith(_VALUE_PREFIXES) and "=" not in arg
        head = re.split(r"[.=]", arg, maxsplit=1)[0]
        if head in table:
            out.append(table[head] + arg[len(head):])
        elif arg.startswith("-O") and len(arg) > 2 and not arg.startswith("--"):
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and argv[i + 1:i + 2] in (["0"], ["1"], ["2"], ["3"]):
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def context_length(value: str | None) -> int | None:
    """--max-model-len as vLLM reads it: 2048, 32k (32000), 32K (32768); "auto" / -1 (the most the
    engine fits) is refused by name, as omni's engines take a number."""
    if value is None:
        return None
    n = human_int(value)
    if n is None:
        why = ("vLLM's auto (the most that fits) needs a number here" if value.strip() in ("auto", "-1")
               else "takes a token count: 2048, 32k (32000) or 32K (32768)")
        raise ConfigError(f"--max-model-len {value}: {why}")
    if n < 1:
        raise ConfigError(f"--max-model-len {value}: must be at least 1")
    return n


def flag_name(key: str, value: Any = None) -> str:
    """The flag as typed where parse_extra_flags did not record it: it reads `--no-x` as x = false."""
    return ("--no-" if value is False else "--") + key.replace("_", "-")


def namer(typed: dict[str, str] | None) -> Callable[..., str]:
    """flag_name, but a key parse_extra_flags recorded in `typed` is named as typed: `--x false` is also
    x = false, and is not `--no-x`."""
    return lambda key, value=None: (typed or {}).get(key) or flag_name(key, value)


def parse_extra_flags(args: list[str], typed: dict[str, str] | None = None) -> dict[str, Any]:
    """`--kv-cache-dtype fp8 --enable-prefix-caching --block-size=16` -> engine args
    (values read as JSON where they parse, else strings; a bare flag is true). vLLM's dotted form
    `--limit-mm-per-prompt.audio 1` sets a key of that flag's JSON object (`--x.y+ a,b`: a list);
    vLLM's human-readable integers (HUMAN_INTS: 8k, 1G) become numbers. A flag of SEVERAL_VALUES takes the
    words that follow it, up to the next flag, as a list. `typed` (given): each plain flag's key -> the flag as
    typed (namer)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        head, dot, path = name.partition(".")
        if dot:                       # as vLLM: the next token is the value, whatever it looks like
            if not eq:
                if i + 1 == len(args):
                    raise ConfigError(f"--{name}: expected a value")
                value = args[i + 1]
                i += 1
            _set_dotted(out, head.replace("-", "_"), path, value, f"--{name}")
            i += 1
            continue
        key = name.replace("-", "_")
        if key in SEVERAL_VALUES:
            values = [value] if eq else []
            while not eq and i + 1 < len(args) and _bare(args[i + 1]):
                values.append(args[i + 1])
                i += 1
            if not values:
                raise ConfigError(f"--{name}: expected one or more values")
            items = [_json_or_text(v) for v in values]
            out[key] = items[0] if len(items) == 1 and isinstance(items[0], list) else items   # '[1, 2]' too
            i += 1
            continue
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        as_typed = f"--{name}"
        if name.startswith("no-") and not eq and value == "true":
            name, value = name[3:], "false"
        key = name.replace("-", "_")
        if typed is not None:
            typed[key] = as_typed
        parsed = _json_or_text(value)
        if isinstance(parsed, dict) and isinstance(out.get(key), dict):
            merge_into(out[key], parsed)  # --x.y 1 --x '{"z": 2}': both keys, as given
        else:
            out[key] = parsed
        i += 1
    return normalise_human_ints(out, flag_name)


def _bare(arg: str) -> bool:
    """A value, not a flag (argparse's rule: a negative number is a value)."""
    return not arg.startswith("-") or re.fullmatch(r"-\d+(\.\d*)?", arg) is not None


def _json_or_text(value: str) -> Any:
    """JSON, where vLLM's bare human-readable numbers ({"cpu_bytes_to_use": 80m}) are read as integers."""
    for text in (value, _expand_numbers(value)):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return value


def _expand_numbers(text: str) -> str:
    """Bare 80m, 1K ... outside JSON strings as their integers (the strings stay as they are)."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b", lambda m: str(human_int(m.group()) or m.group()), parts[i])
    return "".join(parts)


def _set_dotted(out: dict[str, Any], key: str, path: str, value: str, flag: str) -> None:
    keys = path.split(".")
    as_list = keys[-1].endswith("+")
    keys[-1] = keys[-1].removesuffix("+")
    if not all(keys):
        raise ConfigError(f"{flag}: empty key in a dotted flag")
    if as_list:
        leaf: Any = value.split(",")
    else:
        leaf = _json_or_text(value)
        if isinstance(leaf, str) and human_int(leaf) is not None:
            leaf = human_int(leaf)    # --kv-transfer-config.cpu_bytes_to_use 80m, as vLLM
    node = out.setdefault(key, {})
    for k in [*keys[:-1], None]:
        if not isinstance(node, dict):
            raise ConfigError(f"{flag}: {flag_name(key)} is given a value that is not a JSON object; "
                              "a dotted key sets a key of one")
        if k is not None:
            node = node.setdefault(k, {})
    if as_list and isinstance(node.get(keys[-1]), list):
        node[keys[-1]] += leaf        # vLLM joins the lists of a repeated --x.y+
    else:
        node[keys[-1]] = leaf



def _describe(stages: tuple[StageConfig, ...]) -> str:
    return ", ".join(f"{s.label}: {s.engine}" for s in stages)


def spread_flags(config: DeployConfig, flags: dict[str, Any], stage_id: int | None = None,
                 typed: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Single-command mode: {stage id: {arg: value}} for every stage whose engine takes each
    flag. A flag no stage takes is an error naming it (as `typed`, parse_extra_flags') and the stages, except flags
    that only size a GPU engine, which are named and ignored. `stage_id` (stage mode): that stage alone, by the
    same rule, before anything starts (its engine would refuse the key only once built)."""
    from omni.config_engines import flag_type_refusal, kinds
    from omni.config_stage_checks import check_dtype
    from omni.engines.factory import DEVICE_ONLY_ARGS, accepted_args, arg_types, known_elsewhere, takes
    from omni.vllm_serve_flags import LOGGING_ONLY_ARGS, frontend_only

    flag_name = namer(typed)
    stages = config.stages if stage_id is None else (config.stage(stage_id),)
    accepted = {s.engine: accepted_args(s.engine) for s in stages}
    types = {s.engine: arg_types(s.engine) for s in stages}     # a bare --seed is true: refused, not passed on
    who = (f"no stage of this pipeline takes it ({_describe(stages)})" if stage_id is None
           else f"stage {stage_id}'s engine ({stages[0].engine}) does not take it")
    out: dict[str, dict[str, Any]] = {}
    for key, value in flags.items():
        # None: an engine that takes any keyword (it ignores them), or vLLM not installed here.
        takers = [s for s in stages
                  if (s.engine == "vllm" if accepted[s.engine] is None
                      else takes(s.engine, key, value, accepted[s.engine]))]
        if not takers:
            # stage mode: one command line is often shared by every stage (vllm-omni's multi-node style),
            # so a key another engine takes is named and dropped, as engine_args_for does for the YAML
            if key in DEVICE_ONLY_ARGS or key in LOGGING_ONLY_ARGS or key == "enable_sleep_mode" or (
                    stage_id is not None and not frontend_only(key) and known_elsewhere(key)):
                # omni's own engines sleep without it, and log no engine stats
                print(f"omni: {flag_name(key, value)}: {who}; ignored", file=sys.stderr, flush=True)
                continue
            if frontend_only(key):
                raise ConfigError(f"{flag_name(key, value)}: vLLM's serve option, not supported by omni")
            raise ConfigError(vllm_omni_flags.refusal(key, value, (typed or {}).get(key))
                              or f"{flag_name(key, value)}: {who}")
        if value in ("None", "") and all("None" in (kinds(types[s.engine].get(key, "")) or ()) for s in takers):
            value = None      # vLLM's optional_type reads `--block-size None` (or '') as unset
        for s in takers:
            refusal = key in types[s.engine] and flag_type_refusal(flag_name(key, value), value, types[s.engine][key])
            if refusal:
                raise ConfigError(f"{refusal} (for {s.label}, engine {s.engine})")
        for s in takers if key == "dtype" else ():
            check_dtype(value, s.engine, f"{flag_name(key)} ({s.label})")
        others = [s.label for s in stages if s not in takers]
        if others:
            print(f"omni: {flag_name(key)} applies to {', '.join(s.label for s in takers)}; "
                  f"not to {', '.join(others)} (their engines do not take it)", file=sys.stderr, flush=True)
        for s in takers:
            if accepted[s.engine] is None or key in accepted[s.engine]:   # not a neutral no-op
                out.setdefault(str(s.stage_id), {})[key] = value
    return out


def merge_overrides(spread: dict[str, dict], user: dict | None) -> dict[str, dict]:
    """--stage-overrides names a stage explicitly: it wins over a spread flag."""
    out = {k: dict(v) for k, v in spread.items()}
    for k, v in (user or {}).items():
        key = str(k)
        if isinstance(v, dict) and key in out:
            out[key].update(v)
        else:
            out[key] = v
    return out
