"""Checks of a deploy YAML's raw shape (before merging) and of the config's numbers; omni/config.py
validates the rest.

`v <= 0` is False for NaN, so every bound here is written to refuse NaN (and inf where a
finite number is meant): a NaN timeout fires at once or never."""

from __future__ import annotations

import math
from typing import Any

from omni.errors import ConfigError

__all__ = ["CODEC_STOP_KEYS", "NOISE_KEYS", "PIPELINE_SECONDS", "SAMPLING_RANGES", "TALKER_REFUSED", "UNSAMPLED", "VOCODERS",
           "talker_refusal", "check_pipeline", "check_sampling", "check_talker_defaults", "check_yaml_shape",
           "codec_stops", "stage_codec_stops", "unsampled_refusal", "yaml_sections"]

# Seconds the pipeline waits on something; each must be a finite number > 0.
PIPELINE_SECONDS = ("request_timeout_s", "startup_timeout_s", "lease_ttl_s", "stall_timeout_s")
MAX_SPEECH_CHARS = 4096     # OpenAI's limit on /v1/audio/speech input
# The sampling ranges of a request (omni/api/protocol.py check_sampling) and of a stage's
# default_sampling_params; the Piper noise scales: any finite value >= 0. NaN fails every one of these. Integers
# stay in int64 (vLLM's seed bound): a stage's message cannot carry more.
SAMPLING_RANGES = {
    "max_tokens": (lambda v: 1 <= v < 2**63, ">= 1 (and below 2**63)"),
    "temperature": (lambda v: 0.0 <= v <= 2.0, "in [0, 2]"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: -1 <= v < 2**63, "-1, 0 (off) or positive (below 2**63)"),
    "seed": (lambda v: -(2**63) <= v < 2**63, "a 64-bit signed integer"),
    "repetition_penalty": (lambda v: 0.0 < v <= 2.0, "in (0, 2]"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "min_tokens": (lambda v: 0 <= v < 2**63, ">= 0 (and below 2**63)"),
    "noise_scale": (lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
    "noise_w_scale": (lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
}

# A talker engine's own sampling (default_sampling_params, a sampling_params_list entry) it cannot honour:
# refused by name (config load, the frontend, the engine), never ignored; 0 (off) passes.
_CODEC_PENALTY = "omni's talker penalises repeated codes with repetition_penalty only (as transformers' talker)"
TALKER_REFUSED = {engine: {"presence_penalty": _CODEC_PENALTY, "frequency_penalty": _CODEC_PENALTY}
                  for engine in ("qwen3_talker", "qwen25_talker")}
# Engines that sample no tokens: the sampling fields each honours and why it takes no other; a sampling_params_list
# entry setting another away from vLLM's default, or a deploy's default_sampling_params setting one, is refused by
# name. An engine not here samples (an LM; a talker, less its TALKER_REFUSED). Vocoders take an entry whole and use
# what they can (token2wav: its seed): vllm-omni's example clients send its code2wav an entry (temperature 0,
# repetition_penalty 1.1, max_tokens 65536) that vllm-omni ignores too; refusing it would fail those clients on a
# Qwen pipeline.
UNSAMPLED = {
    "piper_talker": (("noise_scale", "noise_w_scale"), "Piper's talker speaks the text; it samples no tokens (its "
                     "noise is the deploy's noise_scale and noise_w_scale, drawn without a seed)"),
    "hidden_pooler": ((), "a pooler returns hidden states; it samples no tokens"),
    "qwen_image": ((), "a diffusion stage takes its steps and seed from the image request"),
    "wan": ((), "a diffusion stage takes its steps and seed from the video request"),
}
VOCODERS = ("qwen3_code2wav", "qwen25_token2wav", "piper_code2wav")
# Piper's VITS noise priors: no other engine reads them, so another stage's default naming one is refused.
NOISE_KEYS = UNSAMPLED["piper_talker"][0]
_OFF = {"top_k": (-1,), "seed": (-1,)}         # an entry's other spellings of vLLM's default (off)


def unsampled_refusal(engine: str | None, entry: Any) -> tuple[str, str] | None:
    """The first field of a sampling_params_list `entry` set away from its default that stage engine `engine`
    (UNSAMPLED) does not honour, and why; None: it honours the entry (or samples: talker_refusal).
    `detokenize` is what omni does anyway, for every stage."""
    honours, why = UNSAMPLED.get(engine or "", (None, ""))
    if honours is None:
        return None
    blank = type(entry)()
    for name in entry.__struct_fields__:
        v = getattr(entry, name)
        if name not in honours and name != "detokenize" and v != getattr(blank, name) and v not in _OFF.get(name, ()):
            return name, why
    return None


# The codes a talker's own stop_token_ids may name (its codec's end): these keys of the model's talker_config,
# read by the talker (which registers them: capabilities codec_stops) and by the load-time check alike.
CODEC_STOP_KEYS = {"qwen3_talker": ("codec_eos_token_id",),
                   "qwen25_talker": ("tts_codec_end_token_id", "tts_codec_pad_token_id")}


def talker_refusal(refused: dict[str, str], own: Any, codec_stops: set[int] | None) -> tuple[str, str] | None:
    """The field of a talker's own sampling (a sampling_params_list entry, its deploy defaults) the talker
    cannot honour and why, or None: the engine raises it, the frontend answers it before the thinker runs.
    refused: its TALKER_REFUSED; codec_stops None: not known (stop_token_ids is then the engine's to check)."""
    for name, why in refused.items():
        if getattr(own, name, None):
            return name, why
    if codec_stops is not None and not set(own.stop_token_ids or ()) <= codec_stops:
        return "stop_token_ids", f"the talker stops at its codec's end {sorted(codec_stops)} and at no other code"
    return None


def codec_stops(engine: str, talker_config: Any) -> set[int] | None:
    """The codes talker `engine` stops at (CODEC_STOP_KEYS of its talker_config: the config object the talker
    loads, or config.json's mapping); None: not a talker, or the config lacks one of them."""
    keys = CODEC_STOP_KEYS.get(engine, ())
    get = talker_config.get if isinstance(talker_config, dict) else lambda k: getattr(talker_config, k, None)
    ids = [get(k) for k in keys] if talker_config is not None else []
    return set(ids) if ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids) else None


def stage_codec_stops(config: Any) -> dict[int, set[int]]:
    """Per talker stage, the codes its own stop_token_ids may name, from the model's config.json read as the
    talker reads it (codec_stops); a talker whose model is not at hand is left out."""
    from omni.models.resolve import model_config

    out = {}
    for s in config.stages:
        if s.engine in CODEC_STOP_KEYS:
            stops = codec_stops(s.engine, (model_config(s.model or config.model) or {}).get("talker_config"))
            if stops is not None:
                out[s.stage_id] = stops
    return out


def check_talker_defaults(config: Any, source: str) -> None:
    """A talker's default_sampling_params that its talker refuses (talker_refusal): every request that takes
    them would fail at the talker after the thinker ran, so the deploy is refused when it loads."""
    stops = stage_codec_stops(config)
    for s in config.stages:
        refused = talker_refusal(TALKER_REFUSED.get(s.engine, {}), s.default_sampling_params, stops.get(s.stage_id))
        if refused is not None:
            name, why = refused
            got = getattr(s.default_sampling_params, name)
            raise ConfigError(f"{source}: stages[{s.stage_id}].default_sampling_params.{name} is not supported by "
                              f"{s.engine}: {why}; got {list(got) if isinstance(got, tuple) else got}")


def check_pipeline(pipeline: Any, source: str) -> None:
    for key in PIPELINE_SECONDS:
        v = getattr(pipeline, key)
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{source}: pipeline.{key} must be > 0 and finite (seconds), got {v}")
    if not 0 <= pipeline.loop_stall_s < math.inf:
        raise ConfigError(f"{source}: pipeline.loop_stall_s must be >= 0 and finite (seconds; 0: never), "
                          f"got {pipeline.loop_stall_s}")
    if pipeline.max_tokens_limit is not None and pipeline.max_tokens_limit < 1:
        raise ConfigError(f"{source}: pipeline.max_tokens_limit must be >= 1 (or unset: the context), "
                          f"got {pipeline.max_tokens_limit}")
    if not 1 <= pipeline.max_speech_chars <= MAX_SPEECH_CHARS:
        raise ConfigError(f"{source}: pipeline.max_speech_chars must be in [1, {MAX_SPEECH_CHARS}], "
                          f"got {pipeline.max_speech_chars}")
    # the model's speakers are fixed (matched in any case); a voice store's voices are not known at load
    if pipeline.voices and pipeline.default_voice is not None and \
            pipeline.default_voice.lower() not in {v.lower() for v in pipeline.voices}:
        raise ConfigError(f"{source}: pipeline.default_voice {pipeline.default_voice!r} is not one of "
                          f"pipeline.voices {list(pipeline.voices)}")


def check_sampling(overrides: Any, where: str, engine: str | None = None) -> None:
    """A stage's default_sampling_params, range-checked as a request's own values are; `engine`: the
    stage's, whose refused parameters (TALKER_REFUSED; UNSAMPLED: any it does not honour) are refused here too."""
    for key in NOISE_KEYS if engine != "piper_talker" else ():
        if getattr(overrides, key) is not None:
            raise ConfigError(f"{where}.default_sampling_params.{key} is not supported by {engine}: it is Piper's "
                              f"VITS noise prior, which only piper_talker reads")
    for key, why in TALKER_REFUSED.get(engine or "", {}).items():
        if getattr(overrides, key, None):
            raise ConfigError(f"{where}.default_sampling_params.{key} is not supported by {engine}: {why}")
    honours, why = UNSAMPLED.get(engine or "", (None, ""))
    # Any value, vLLM's default too: unlike a client's whole entry, a deploy names only what it means to set.
    for key in overrides.set() if honours is not None else ():
        if key not in honours:
            raise ConfigError(f"{where}.default_sampling_params.{key} is not supported by {engine}: {why}")
    for key, v in overrides.set().items():
        ok, wanted = SAMPLING_RANGES.get(key, (None, ""))
        if ok is not None and not ok(v):
            raise ConfigError(f"{where}.default_sampling_params.{key} must be {wanted}, got {v}")
    # int64 as a request's (protocol.TokenId): past it the stage's message cannot carry the id
    if any(not 0 <= t < 2**63 for t in overrides.stop_token_ids or ()):
        raise ConfigError(f"{where}.default_sampling_params.stop_token_ids must be token ids in [0, 2**63), "
                          f"got {list(overrides.stop_token_ids)}")


def yaml_sections(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The parts of a deploy YAML that hold `stages`, with their key prefix: the top level and each
    `platforms.<name>` section."""
    platforms = data.get("platforms")
    return [("", data)] + [(f"platforms.{k}.", v) for k, v in (platforms if isinstance(platforms, dict) else {}).items()
                           if isinstance(v, dict)]


def check_yaml_shape(data: Any, path: Any) -> dict[str, Any]:
    """The shape every loading step walks: a mapping whose `stages` are lists, with integer stage ids
    (merging sorts and matches stages by id before the typed check could name a bad one)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    platforms = data.get("platforms")
    if platforms is not None and not isinstance(platforms, dict):
        raise ConfigError(f"{path}: `platforms` must be a mapping of platform -> overrides")
    for where, section in yaml_sections(data):
        stages = section.get("stages")
        if stages is not None and not isinstance(stages, list):
            raise ConfigError(f"{path}: `{where}stages` must be a list of stages, got {type(stages).__name__}")
        for i, stage in enumerate(stages or []):
            if not isinstance(stage, dict):   # merging by stage_id passed it over: a platform's section dropped it
                raise ConfigError(f"{path}: `{where}stages[{i}]` must be a mapping of a stage's keys, "
                                  f"got {type(stage).__name__}: {stage!r:.80}")
            sid = stage.get("stage_id", 0)
            if not isinstance(sid, int) or isinstance(sid, bool):
                raise ConfigError(f"{path}: `{where}stages[{i}].stage_id` must be an integer, got {sid!r}")
    return data
