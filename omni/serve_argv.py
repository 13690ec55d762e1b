"""`omni serve`'s MODEL as `vllm serve` takes it, before the argv is parsed: positional, `--model MODEL`, or
`model:` in a `--config FILE.yaml`, vLLM's YAML of flags, which is spelled out into the argv here as vLLM's
FlexibleArgumentParser does (`key: value` is `--key value`, `true` a bare `--key`, `false` `--no-key`, a list
several values, a mapping one JSON value). The command line wins over the file: the file's flags go right
after MODEL, so a flag given again later replaces them. Secrets in the file (api-key, omni-token ...) go to
the environment variable omni reads for them, never onto the argv (the process title shows it). With --headless
the file's head-only flags (--host, --port ...) are left out with a note: one file serves the head and its nodes."""

from __future__ import annotations

import json
import os
import sys

from omni.cli_argv import canonical
from omni.errors import ConfigError

# The file's secret keys: the environment variable each is read from (omni.cli_argv.SECRET_FLAGS).
_SECRET_ENV = {"api-key": "OMNI_API_KEY", "omni-token": "OMNI_TOKEN", "control-api-key": "OMNI_CONTROL_API_KEY",
               "hf-token": "HF_TOKEN"}

# serve's own on/off flags, which have no --no- form: false leaves them off (--no-enforce-eager is an engine flag).
_OWN_SWITCHES = ("--dry-run", "--headless", "--omni", "--disable-control-routes")


def normalise(argv: list[str]) -> list[str]:
    """`serve [MODEL] ... [--model MODEL] [--config FILE]` -> `serve MODEL <the file's flags> ...`. Two different
    models (MODEL and --model) are refused; none at all is left to `serve`, which names MODEL / --model."""
    if argv[:1] != ["serve"] or any(a in ("-h", "--help") for a in _before_dashes(argv)):
        return argv
    end = argv.index("--") if "--" in argv else len(argv)
    rest, tail = argv[1:end], argv[end:]
    models = _take(rest, "--model")
    files = _take(rest, "--config")
    if not models and not files:
        return argv
    if len(files) > 1:
        raise ConfigError("--config: given more than once; vLLM takes one file of flags")
    if len(set(models)) > 1:
        raise ConfigError(f"--model: given more than once with different models ({', '.join(models)}); give one")
    at = _positional(rest)
    positional = rest.pop(at) if at is not None else None
    if positional is not None and models and positional != models[0]:
        raise ConfigError(f"MODEL {positional} and --model {models[0]} are two models; give one (--model is "
                          "vLLM's other spelling of MODEL)")
    model = positional or (models[0] if models else None)
    from_file: list[str] = []
    if files:
        file_model, from_file = load_config_file(files[0])
        model = model or file_model   # the command line's MODEL wins, as in vLLM
        if "--headless" in rest or "--headless" in from_file:
            from_file = _drop_head_only(from_file, files[0])
    return ["serve", *([model] if model else []), *from_file, *rest, *tail]


def _before_dashes(argv: list[str]) -> list[str]:
    return argv[:argv.index("--")] if "--" in argv else argv


def _drop_head_only(from_file: list[str], path: str) -> list[str]:
    """The file's flags less the head's (--host, --port ...): one file shared by the head and its headless
    nodes is vLLM's usual setup, and serve refuses those flags only when typed with --headless."""
    from omni.serve_modes import HEAD_ONLY

    head = set(HEAD_ONLY.values())
    kept, dropped, skip = [], [], False
    for a in from_file:
        if a.startswith("--"):
            skip = a in head
            if skip:
                dropped.append(a)
        if not skip:
            kept.append(a)
    if dropped:
        print(f"omni: note: {', '.join(dropped)} from --config {path}: ignored with --headless (the head's flags)",
              file=sys.stderr)
    return kept


def _take(args: list[str], flag: str) -> list[str]:
    """Remove each `flag VALUE` / `flag=VALUE` from `args`; their values, in order."""
    values, i = [], 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name != flag:
            i += 1
            continue
        if eq:
            values.append(inline)
            del args[i]
        elif i + 1 < len(args):
            values.append(args[i + 1])
            del args[i:i + 2]
        else:
            raise ConfigError(f"{flag}: expected a value" + (" (a YAML file of flags)" if flag == "--config" else ""))
    return values


def _positional(args: list[str]) -> int | None:
    """Where MODEL is: the first word that is neither one of serve's options nor the value one takes. With
    --model or --config, as in vLLM's parser, a several-value flag (`--api-key K1 K2`) takes the words up to
    the next option. After an option serve does not know (an engine flag) the next word may be its value:
    not looked at."""
    from omni.cli_argv import _VALUE_PREFIXES, SEVERAL_VALUES, _serve_options

    takes, flags = _serve_options()
    i = 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name in SEVERAL_VALUES:
            i += 1 if eq else 2
            while i < len(args) and not args[i].startswith("-"):
                i += 1
        elif name in takes or name.startswith(_VALUE_PREFIXES):
            i += 1 if eq else 2
        elif name in flags:
            i += 1
        elif name.startswith("-"):
            return None
        else:
            return i
    return None


def load_config_file(path: str) -> tuple[str | None, list[str]]:
    """(the file's model, its other keys as flags), as vLLM's FlexibleArgumentParser.load_config_file reads it."""
    import yaml

    from omni.config_yaml import safe_load

    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(f"--config {path}: expected a YAML file of flags (.yaml or .yml), as vLLM's --config")
    try:
        with open(path) as f:
            data = safe_load(f, f"--config {path}")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return None, []
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    model, out = None, []
    for key, value in data.items():
        name = canonical(f"--{key}")[2:]   # as vLLM: the flag's name respelled, not a dotted JSON path's keys
        where = f"--config {path}: {key}"
        if value is None:
            raise ConfigError(f"{where}: no value (give one, or leave the key out)")
        if name == "model":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: expected a model id or folder")
            model = value
        elif name == "config":
            raise ConfigError(f"{where}: a config file cannot name another")
        elif name in _SECRET_ENV:
            _secret_to_env(name, value, where)
        elif isinstance(value, bool):
            if value:
                out.append(f"--{name}")
            elif f"--{name}" not in _OWN_SWITCHES:
                out.append(f"--no-{name}")
        elif isinstance(value, list):
            if value:
                out += [f"--{name}", *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [f"--{name}", json.dumps(value)]
        else:
            out += [f"--{name}", str(value)]
    return model, out


def _secret_to_env(name: str, value: object, where: str) -> None:
    if name == "hf-token" and value is True:
        return   # vLLM's bare --hf-token: the token `huggingface-cli login` saved, which the Hub reads anyway
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        several = " (several API keys: --api-key K1 K2 on the command line)" if isinstance(value, list) else ""
        raise ConfigError(f"{where}: expected one non-empty string{several} (the value is not shown)")
    os.environ[_SECRET_ENV[name]] = value   # the command line's flag still wins over the environment
