"""`omni serve`'s argv before typer parses it: vLLM's several-value flags spread out (the last one
given wins, as vLLM's nargs="+"), and the secrets masked for the process title."""

from __future__ import annotations

import functools
import os
import re
import sys

from omni.cli_secrets import json_flag, mask_json_flag
from omni.errors import ConfigError

__all__ = ["SECRET_FLAGS", "SEVERAL_VALUES", "hide_secrets", "mask_in_message", "reexec_with_env",
           "spread_several_values", "take_hf_token"]

SECRET_FLAGS = {"--omni-token": "OMNI_TOKEN", "--api-key": "OMNI_API_KEY",
                "--control-api-key": "OMNI_CONTROL_API_KEY", "--hf-token": "HF_TOKEN"}
# vLLM's --hf-token may come bare (the token `huggingface-cli login` saved): a flag after it is not its value.
_OPTIONAL_VALUE = ("--hf-token",)
# vLLM's nargs="+" flags: typer takes a list option once per value, so `--api-key K1 K2` is
# spelled `--api-key K1 --api-key K2` before parsing.
SEVERAL_VALUES = ("--served-model-name", "--api-key", "--allowed-hosts")
# Flags whose name is spelled out later (omni.cli.SHORT_FLAGS) or folded (omni.cli.JSON_FLAGS' dotted
# forms): each takes one value.
_VALUE_PREFIXES = ("--stage-overrides.", "--engine-args.")
_SHORT_VALUE_FLAGS = ("-oma", "-omp", "-ora")
# The arguments `omni` was started with (omni.cli.main sets it): what reexec_with_env runs again.
given: list[str] | None = None


def hide_secrets(argv: list[str]) -> list[str]:
    """argv with secret values masked (also hf_token and env values inside --engine-args / --stage-overrides);
    warns about each secret given on the command line, where every user on the host can read it
    (/proc/PID/cmdline)."""
    out, hide, warned = [], "", set()
    for arg in argv:
        name, eq, inline = arg.partition("=")
        if hide and not _bare(hide, arg):
            out.append(_hidden(hide, arg, warned))
            hide = ""
            continue
        hide = ""
        flag = canonical(name)
        if flag in SECRET_FLAGS or json_flag(flag):
            out.append(f"{name}={_hidden(flag, inline, warned)}" if eq else arg)
            hide = "" if eq else flag
        else:
            out.append(arg)
    return out


def _hidden(flag: str, value: str, warned: set) -> str:
    """`value` of `flag` as the process title shows it; warns about each secret once."""
    if flag in SECRET_FLAGS:
        masked, found = "***", {flag: SECRET_FLAGS[flag]}
    else:
        masked, found = mask_json_flag(flag, value)
    for what, env in found.items():
        if what not in warned:
            warned.add(what)
            print(f"omni: warning: {what} on the command line is visible to every user of this host (ps); "
                  f"set {env} in the environment instead", file=sys.stderr)
    return masked


def canonical(name: str) -> str:
    """A flag as vLLM reads it: `--hf_token` is `--hf-token` (the part before a first dot; after it, a JSON
    path whose keys keep their spelling)."""
    if not name.startswith("--"):
        return name
    head, dot, rest = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest


def _bare(flag: str, following: str) -> bool:
    """`flag` given without a value: `following` is the next flag."""
    return flag in _OPTIONAL_VALUE and following.startswith("--")


def take_hf_token(flags: dict) -> None:
    """vLLM's --hf-token (also in --engine-args), taken out of the engine flags: as an engine flag it would go
    on every stage child's argv and, in single-command mode, into the hashed config the master shows. It is
    the Hugging Face Hub's HF_TOKEN, which vLLM's and omni's loaders read: set so here, the stages inherit it
    (a stage's own `env` HF_TOKEN wins for that stage). Bare (true): the token `huggingface-cli login`
    saved, which the Hub reads anyway."""
    if "hf_token" not in flags:
        return
    value = flags.pop("hf_token")
    if value is True or value is None:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError("--hf-token: expected a Hugging Face token, or no value for the one `huggingface-cli "
                          "login` saved (the value given is not shown)")
    os.environ["HF_TOKEN"] = value


@functools.lru_cache(maxsize=1)
def _serve_options() -> tuple[frozenset[str], frozenset[str]]:
    """(options of `omni serve` that take a value, its flags that take none), from typer's command."""
    import typer

    from omni.cli import app

    command = typer.main.get_command(app).commands["serve"]
    takes, flags = {*_SHORT_VALUE_FLAGS}, {"-h", "--help"}
    for param in command.params:
        if param.param_type_name == "option":
            (flags if param.is_flag or param.count else takes).update([*param.opts, *param.secondary_opts])
    return frozenset(takes), frozenset(flags)


def spread_several_values(argv: list[str]) -> list[str]:
    """`serve MODEL --api-key K1 K2` -> `serve MODEL --api-key K1 --api-key K2` (also `--api-key=K1 K2`): the
    values run up to the next token that starts with "-". Before MODEL (`serve --dry-run MODEL ...`) each such
    flag takes its one value, as typer does (the next bare word is MODEL). A flag given more than once keeps
    its last values only, as vLLM's nargs="+" does: `--api-key OLD --api-key NEW` accepts NEW alone.

    MODEL is found as typer finds it: the first token that is neither one of serve's options (with the value
    an option takes) nor after `--`."""
    if not argv or argv[0] != "serve":
        return argv
    takes, flags = _serve_options()
    # Each item: a token to keep, or (flag, values) for one of SEVERAL_VALUES.
    items: list[str | tuple[str, list[str]]] = ["serve"]
    model_seen, i = False, 1
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            items += argv[i - 1:]
            break
        name, eq, inline = arg.partition("=")
        if name in SEVERAL_VALUES:
            if eq:
                values = [inline]
            elif i < len(argv):       # its first value, whatever it looks like (as typer reads it)
                _refuse_flag_as_value(name, argv[i])
                values = [argv[i]]
                i += 1
            else:
                items.append(arg)     # no value: typer names the flag
                continue
            while model_seen and i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            _refuse_stray_secret(name, argv[i:i + 2], model_seen)
            items.append((name, values))
        else:
            items.append(arg)
            if name in takes or name.startswith(_VALUE_PREFIXES):
                if not eq and i < len(argv):
                    _refuse_flag_as_value(name, argv[i])
                    items.append(argv[i])
                    i += 1
                _refuse_stray_secret(name, argv[i:i + 2], model_seen)
            elif name not in flags and not model_seen:
                model_seen = True     # typer's MODEL (an unknown option here would be taken as MODEL too)
    last = {item[0]: n for n, item in enumerate(items) if isinstance(item, tuple)}
    out: list[str] = []
    for n, item in enumerate(items):
        if isinstance(item, str):
            out.append(item)
        elif last[item[0]] == n:      # an earlier occurrence of the flag is dropped
            for value in item[1]:
                out += [item[0], value]
    return out


def _refuse_flag_as_value(name: str, value: str) -> None:
    """`--api-key $KEY --port 1` with KEY empty: the shell drops the word, and `--port` would be taken as the key
    (the server then open, the next flag's value a key). A value shaped as a long flag is refused, as vLLM's
    argparse refuses it ("expected at least one argument"); short words (-k1, -q) stay values."""
    if re.fullmatch(r"--[A-Za-z][\w.-]*(=.*)?", value, re.DOTALL):
        raise ConfigError(f"{name}: no value given (the next word is the flag {value.partition('=')[0]}); "
                          "an empty value in a shell variable drops out of the command line")


def _refuse_stray_secret(name: str, following: list[str], model_seen: bool) -> None:
    """A word after a secret flag's value(s) that typer could not place fails there as "unexpected argument
    'WORD'": refused here instead, without echoing it (it may be a key). `following`: the next two tokens."""
    if name not in SECRET_FLAGS:
        return
    bare = [not token.startswith("-") for token in following]
    if model_seen and bare[:1] == [True]:       # after MODEL: --api-key took every bare word already
        raise ConfigError(f"{name} takes one value; the word after it is unexpected (not shown: it may be a "
                          "secret)")
    if not model_seen and bare == [True, True]:  # the first would be MODEL, the second is unexpected
        raise ConfigError(f"{name}: more words follow its value than MODEL (not shown: they may be secrets); put "
                          f"MODEL right after `serve`: omni serve MODEL {name} VALUE ..."
                          + (" (several keys: --api-key K1 K2)" if name == "--api-key" else ""))


def mask_in_message(message: str, argv: list[str]) -> str:
    """An error message with each word that follows a secret flag on the command line (its value, and the
    bare words after it: more keys, or MODEL typed after a key), and a JSON flag's value that holds a secret,
    shown as '***' where it is quoted."""
    words, i = set(), 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        name = canonical(name)
        i += 1
        if json_flag(name) and (eq or i < len(argv)):     # its whole value, when it holds a secret
            text = inline if eq else argv[i]
            i += 0 if eq else 1
            if mask_json_flag(name, text)[0] != text:
                words.add(text)
            continue
        if name not in SECRET_FLAGS:
            continue
        if eq:
            words.add(inline)
        elif i < len(argv) and not _bare(name, argv[i]):
            words.add(argv[i])
            i += 1
        while i < len(argv) and not argv[i].startswith("-"):
            words.add(argv[i])
            i += 1
    for word in sorted(words - {""}, key=len, reverse=True):
        message = message.replace(repr(word), "'***'")
    return message


def reexec_with_env(env: dict[str, str]) -> None:
    """`omni serve --headless` with one replica runs its stage in this process: the stage's `env` must be there
    from the interpreter's start, as it is for the launcher's children (LD_PRELOAD, MALLOC_* act at exec only;
    torch, numpy and OpenMP read theirs as they load, and loading the config may have loaded them). Unless it is
    in place already, `omni` starts again, the same arguments with the env added (same PID: exec)."""
    if not env or all(os.environ.get(k) == v for k, v in env.items()):
        return
    if given is None:   # not started through omni.cli.main (a test's runner): nothing to start again
        print("omni: warning: the stage's env is set after start-up here (LD_PRELOAD and what loaded modules read "
              "take no effect)", file=sys.stderr, flush=True)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "omni.cli", *given], {**os.environ, **env})


def merge_into(a: dict, b: dict) -> None:
    """`b`'s keys into `a`, nested objects key by key (--x.y 1 --x '{"z": 2}': both keys, as given)."""
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            merge_into(a[k], v)
        else:
            a[k] = v
