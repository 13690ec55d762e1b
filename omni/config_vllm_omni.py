"""vllm-omni's deploy YAML, read as an omni deploy overlay.

vllm-omni pairs a deploy YAML with the pipeline its model registers: the file names no engines and
no processors, only per-stage placement, sizes and sampling (engine args flat on the stage),
connectors between stages and a few pipeline-wide keys. omni's bundled deploy for MODEL plays the
registered pipeline's part: a file that names no model and whose stages name no engine is merged
over it (config.load).

`translate` turns the keys only vllm-omni's schema has into omni's, before the flat engine args are
nested under `engine_args`:
  async_chunk          false: the stage that makes audio decodes each utterance whole (its engine's
                       `stream: false`); the stages before still hand over pieces as they come, which
                       gives the same text and codes as whole outputs would
  stages[i].async_chunk
                       false opts stage i out (true changes nothing, as in vllm-omni): the stage that
                       makes audio alone decodes whole, as above; any other stage only with every stage
                       it exchanges pieces with (vllm-omni refuses an edge chunked at one end only), which
                       changes no text or codes here; else refused naming the stage and the edge. Also
                       read from the stage's engine_args / engine_extras (vllm-omni's OmniEngineArgs field,
                       a legacy stage_args entry's too) and --stage-overrides (lift_chunk): never an engine's
  pipeline: NAME       a structural variant (qwen3_omni_moe_thinker_only): omni's bundled file for it
  connectors, input_connectors / output_connectors
                       the edge's transport: SharedMemoryConnector -> auto (shared memory between
                       processes on one host, CUDA IPC for CUDA tensors, TCP or NCCL between hosts);
                       its `extra` codec keys -> the receiving code2wav's engine args (frames, >= 1:
                       omni's code2wav needs a frame of left context, refused by key at load)
  engine_extras        the stage's engine args (a key set on the stage itself wins)
  stages[i].runtime    devices, num_replicas, env, max_batch_size (max_num_seqs) as if set on the stage
                       (a key set on the stage itself wins; env merges)
  stages[i].env, stages[i].subtalker_sampling_params
                       taken as they are: the stage process's environment (a stage field, checked in
                       omni/config_stage_checks.py), the code predictor's sampling (qwen3_talker's engine arg)
  trust_remote_code, dtype, ... (pipeline-wide)
                       every stage's engine arg unless the stage sets it (spread by config.load)
vllm-omni's bundled file names in `base_config` (qwen3_omni_moe.yaml) resolve to omni's. A key that
picks vllm-omni's own implementation (model_runner) is named and dropped; a key with no meaning in
omni (edges, duplex sessions, other connector classes, a voice directory) is refused by name.
vllm-omni's legacy stage configs (`stage_args:`) are turned into this shape first, by
omni/config_legacy_stages.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

from omni.config_stage_checks import is_count
from omni.config_types import STAGE_FIELDS
from omni.digits import ascii_int
from omni.errors import ConfigError

# vllm-omni's bundled deploy names (its `pipeline:` keys, its deploy file stems) -> omni's bundled deploy.
BUNDLED = {"qwen3_omni_moe": "qwen3-omni-moe", "qwen3_omni_moe_thinker_only": "qwen3-omni-moe-thinker-only",
           "qwen2_5_omni": "qwen2.5-omni-7b"}
PIPELINE_WIDE = ("trust_remote_code", "distributed_executor_backend", "dtype", "quantization",
                 "enable_prefix_caching", "enable_chunked_prefill", "data_parallel_size", "pipeline_parallel_size")
# Carry the pipeline-wide engine args and the connectors' codec args through base_config merges;
# config.load applies and removes them.
EVERY_STAGE = "every_stage_engine_args"
CODEC_ARGS = "codec_engine_args"        # receiving stage id -> engine args
WHOLE = "whole_utterances"              # async_chunk: false
STAGE_CHUNK = "stage_async_chunk"       # stage id -> that stage's own async_chunk
CONNECTOR_TRANSPORTS = {"SharedMemoryConnector": "auto"}
# A connector's `extra` codec keys -> engine args of omni's Qwen3 code2wav: they shape the codec stream
# into the stage that makes audio, and mean nothing on the other edges (as in vllm-omni).
CONNECTOR_EXTRAS = {"codec_chunk_frames": "chunk_frames", "codec_left_context_frames": "context_frames"}
DROPPED = {"model_runner": "vllm-omni's model runner (omni's stages run omni's engines)"}
REFUSED = {
    "edges": "omni derives the edges from each stage's inputs",
    "duplex_session": "omni serves turn-based sessions only",
    "custom_voice_dir": "voices are uploaded through /v1/audio/voices and kept by the master (--state-dir)",
}
_printed: set[str] = set()


def bundled_path(name: str | Path) -> Path | None:
    """omni's bundled deploy for one of vllm-omni's bundled names (a path to vllm-omni's file too)."""
    from omni.config import DEPLOY_DIR

    stem = Path(name).stem
    return DEPLOY_DIR / f"{BUNDLED[stem]}.yaml" if stem in BUNDLED else None


def vllm_omni_deploy(name: str) -> Path | None:
    """--deploy-config as vllm-omni's docs write it (vllm_omni/deploy/qwen3_omni_moe.yaml) where no such file is:
    omni's bundled deploy for it, with a note; a vllm-omni file omni has none for is refused, listing what it has."""
    path = Path(name)
    ours_like = path.stem in BUNDLED or any(path.stem.startswith(f"{k}_") for k in BUNDLED)  # _multi_replicas
    if path.exists() or not (ours_like or "vllm_omni" in path.parts):
        return None
    ours = bundled_path(path)
    if ours is None:
        from omni.config import DEPLOY_DIR

        raise ConfigError(f"--deploy-config: {name}: no such file, and omni has no variant like vllm-omni's "
                          f"{path.name} (vllm-omni's names it reads: {', '.join(f'{k}.yaml' for k in BUNDLED)}; "
                          f"its own: {', '.join(sorted(p.stem for p in DEPLOY_DIR.glob('*.yaml')))})")
    note("--deploy-config", f"{name} is vllm-omni's bundled deploy; omni's {ours.stem} stands for it")
    return ours


def note(source: str, text: str) -> None:
    """One line on stderr, once per process (the CLI loads the config more than once)."""
    line = f"omni: {source}: {text}"
    if line not in _printed:
        _printed.add(line)
        print(line, file=sys.stderr, flush=True)


def translate(data: dict[str, Any], source: str) -> dict[str, Any]:
    """One YAML file's keys in omni's shape (a file in omni's own shape comes back unchanged)."""
    data = copy.deepcopy(data)
    if "stage_args" in data:
        from omni.config_legacy_stages import from_stage_args   # here: that module imports this one

        data = from_stage_args(data, source)
    _top_level(data, source)
    from omni.config import yaml_sections

    connectors = _connectors(data.pop("connectors", None), source)
    for prefix, section in yaml_sections(data):
        if isinstance(section.get("stages"), list):
            codec, chunk = _stages(section["stages"], connectors, source, f"{prefix}stages")
            if codec:
                section[CODEC_ARGS] = codec
            if chunk:
                section[STAGE_CHUNK] = chunk
    return data


def _top_level(data: dict[str, Any], source: str) -> None:
    if "async_chunk" in data:
        value = data.pop("async_chunk")
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: async_chunk must be true or false, got {value!r}")
        data[WHOLE] = not value
    pipeline = data.get("pipeline")
    if isinstance(pipeline, str):
        del data["pipeline"]
        path = bundled_path(pipeline)
        if path is None:
            raise ConfigError(f"{source}: pipeline: {pipeline!r} is not a pipeline omni has (known: "
                              f"{', '.join(sorted(BUNDLED))}; omni's own variants: --deploy-config NAME)")
        if data.get("base_config"):
            raise ConfigError(f"{source}: `pipeline` and `base_config` both pick the pipeline; keep one")
        data["base_config"] = str(path)
    if data.get("session_mode", "turn") != "turn":
        raise ConfigError(f"{source}: session_mode: {data['session_mode']!r} is not supported: "
                          "omni serves turn-based sessions only")
    data.pop("session_mode", None)
    if data.get("active_stream_window", 0) != 0:
        raise ConfigError(f"{source}: active_stream_window: {data['active_stream_window']!r} is not supported "
                          "(omni steps every active stream)")
    data.pop("active_stream_window", None)
    for key, why in REFUSED.items():
        if key in data:
            raise ConfigError(f"{source}: `{key}` is not supported: {why}")
    for key, what in DROPPED.items():
        if key in data:
            note(source, f"{key}: {data.pop(key)!r} ignored: {what}")
    if data.get("distributed_executor_backend") == "ray":
        raise ConfigError(f"{source}: distributed_executor_backend: 'ray' is not supported: omni runs without "
                          "Ray (each stage replica is its own process; use 'mp' or leave it out)")
    wide = {k: data.pop(k) for k in PIPELINE_WIDE if k in data}
    if wide:
        data[EVERY_STAGE] = {**wide, **(data.get(EVERY_STAGE) or {})}


def _connectors(raw: Any, source: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """`connectors:` name -> (omni transport, engine args for the receiving stage)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: connectors must be a mapping of name -> {{name, extra}}")
    out = {}
    for name, spec in raw.items():
        where = f"{source}: connectors.{name}"
        if not isinstance(spec, dict) or "name" not in spec:
            raise ConfigError(f"{where}: needs `name`, the connector class (SharedMemoryConnector)")
        unknown = sorted(set(spec) - {"name", "extra"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (a connector has name and extra)")
        cls = spec["name"]
        if not isinstance(cls, str):   # a list or mapping is no class name (and unhashable below)
            raise ConfigError(f"{where}.name must be one connector class's name (SharedMemoryConnector), got {cls!r}")
        if cls not in CONNECTOR_TRANSPORTS:
            raise ConfigError(f"{where}.name: {cls!r} is not supported: omni moves tensors itself (shared memory "
                              "or CUDA IPC on one host, TCP or NCCL between hosts), so SharedMemoryConnector or "
                              "no connector serves every placement")
        extra = spec.get("extra") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"{where}.extra must be a mapping")
        args = {}
        for key, value in extra.items():
            if key not in CONNECTOR_EXTRAS:
                raise ConfigError(f"{where}.extra.{key} is not supported (omni takes "
                                  f"{', '.join(CONNECTOR_EXTRAS)})")
            if not is_count(value):
                # vllm-omni's 0 context cuts at frame edges, dropping the tail each chunk holds back; omni's
                # code2wav decodes that tail again from the next chunk's left context (>= 1 frame).
                raise ConfigError(f"{where}.extra.{key} must be a number of frames >= 1, got {value!r}")
            args[CONNECTOR_EXTRAS[key]] = value
        out[name] = (CONNECTOR_TRANSPORTS[cls], args)
    return out


def _stages(stages: list, connectors: dict[str, tuple[str, dict[str, Any]]], source: str,
            key_path: str) -> tuple[dict[int, dict], dict[int, bool]]:
    """Rewrites the stages in place (`key_path`: where they sit in the file); returns the codec args
    per receiving stage id and the stages' own async_chunk."""
    codec: dict[int, dict[str, Any]] = {}
    chunk: dict[int, bool] = {}
    by_id = {s.get("stage_id"): s for s in stages if isinstance(s, dict)}

    def entry(stage_id: int) -> dict[str, Any]:
        if stage_id not in by_id:
            by_id[stage_id] = {"stage_id": stage_id}
            stages.append(by_id[stage_id])
        return by_id[stage_id]

    for s in [s for s in stages if isinstance(s, dict)]:
        sid = s.get("stage_id")
        here = f"{source}: {key_path}[stage_id {sid}]"
        if "runtime" in s:          # the same keys under `runtime:`; a key set on the stage itself wins
            for key, value in stage_runtime(s.pop("runtime"), f"{here}.runtime").items():
                if key == "engine_args":
                    for k, v in value.items():
                        s.setdefault(k, v)
                elif key == "env" and isinstance(value, dict) and isinstance(s.get("env"), dict):
                    s["env"] = {**value, **s["env"]}
                else:
                    s.setdefault(key, value)
        extras = s.pop("engine_extras", None)
        if extras is not None:
            if not isinstance(extras, dict):
                raise ConfigError(f"{here}.engine_extras must be a mapping")
            for key, value in extras.items():
                if key in STAGE_FIELDS:
                    raise ConfigError(f"{here}.engine_extras.{key}: a stage field, not an engine arg; "
                                      "set it on the stage")
                s.setdefault(key, value)        # flat: an engine arg, nested by config; the stage's own wins
        own = lift_chunk(s, here)
        if own is not None:
            chunk[sid] = own
        for key, what in DROPPED.items():
            if key in s:
                note(source, f"stage {sid}: {key}: {s.pop(key)!r} ignored: {what}")
        for key, prefix in (("input_connectors", "from_stage_"), ("output_connectors", "to_stage_")):
            edges = s.pop(key, None)
            if edges is None:
                continue
            if not isinstance(edges, dict):
                raise ConfigError(f"{here}.{key} must be a mapping of {prefix}N -> connector name")
            for edge, name in edges.items():
                other = _edge_stage(str(edge), prefix, f"{here}.{key}")
                if isinstance(name, (list, dict)) or name not in connectors:   # a name, as `connectors` keys it
                    raise ConfigError(f"{here}.{key}.{edge}: no connector named {name!r} under `connectors` "
                                      f"(defined: {', '.join(map(str, connectors)) or 'none'})")
                transport, args = connectors[name]
                up, down = (other, sid) if key == "input_connectors" else (sid, other)
                edge_map = entry(up).setdefault("connectors", {})
                if isinstance(edge_map, dict):
                    edge_map[str(down)] = {"transport": transport}
                if args:
                    codec[down] = {**args, **codec.get(down, {})}
    return codec, chunk


def lift_chunk(stage: dict[str, Any], where: str) -> bool | None:
    """The stage's own async_chunk taken out of it: flat on the stage or in its engine_args (vllm-omni's
    OmniEngineArgs field; the engine_args' wins, as an engine arg does over a flat one); None: not set."""
    found = {}
    if "async_chunk" in stage:
        found[where] = stage.pop("async_chunk")
    args = stage.get("engine_args")
    if isinstance(args, dict) and "async_chunk" in args:
        stage["engine_args"] = {k: v for k, v in args.items() if k != "async_chunk"}
        found[f"{where}.engine_args"] = args["async_chunk"]
    for here, value in found.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{here}.async_chunk must be true or false, got {value!r}")
    return list(found.values())[-1] if found else None


def lift_override_chunk(data: dict[str, Any], overrides: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """--stage-overrides' async_chunk (on the stage or in its engine_args) as the stage's own async_chunk,
    before apply_carried reads it (it wins over the YAML's); -> the overrides without it, and the source
    apply_carried names."""
    out = copy.deepcopy(overrides) if isinstance(overrides, dict) else overrides
    for key, patch in (out.items() if isinstance(out, dict) else ()):
        stage_id = ascii_int(key.strip()) if isinstance(patch, dict) and isinstance(key, str) else None
        if stage_id is not None:
            own = lift_chunk(patch, f"--stage-overrides: stages[{stage_id}]")
            if own is not None:
                data.setdefault(STAGE_CHUNK, {})[stage_id] = own
                source = f"{source.removesuffix(' with --stage-overrides')} with --stage-overrides"
    return out, source


def apply_carried(data: dict[str, Any], async_chunk: bool | None, source: str = "deploy config") -> None:
    """After the merges (config.load): vllm-omni's pipeline-wide engine args go to every stage, its
    connectors' codec args to the stage that makes audio (a stage's own engine args win), and
    async_chunk: false (pipeline-wide, or that stage's own) to that stage as `stream: false`
    (--no-async-chunk sets it over the stage's own, --async-chunk undoes the YAML's async_chunk, the
    stages' own too)."""
    wide = data.pop(EVERY_STAGE, None) or {}
    codec = data.pop(CODEC_ARGS, None) or {}
    whole = data.pop(WHOLE, False)
    own_chunk = data.pop(STAGE_CHUNK, None) or {}
    whole = whole if async_chunk is None else not async_chunk
    stages = [s for s in data.get("stages") or [] if isinstance(s, dict)]
    off = set() if async_chunk is not None else _opted_out(stages, own_chunk, whole, source)
    for stage in stages:
        if not isinstance(stage.setdefault("engine_args", {}), dict):
            continue
        audio = stage.get("final_output_type") == "audio"
        decode_whole = audio and (whole or stage.get("stage_id") in off)
        if decode_whole:
            _check_whole_decode(stage)
        own = {**wide, **(codec.get(stage.get("stage_id"), {}) if audio else {}),
               **({"stream": False} if decode_whole else {})}
        for key, value in own.items():
            stage["engine_args"].setdefault(key, value)
        if audio and async_chunk is False:
            stage["engine_args"]["stream"] = False


def _opted_out(stages: list[dict], own: dict[int, bool], whole: bool, source: str) -> set[int]:
    """The stages whose own async_chunk is false. vllm-omni chunks a stage when the pipeline does and the
    stage does not opt out, and refuses an edge chunked at one end only; here the stage that makes audio may
    opt out alone (its input still comes in pieces, it decodes each utterance whole)."""
    off = {sid for sid, on in own.items() if on is False}
    if whole or not off:
        return off
    ups = {s.get("stage_id"): [i for i in s.get("inputs") or [] if isinstance(i, int) and not isinstance(i, bool)]
           for s in stages}
    audio = {s.get("stage_id") for s in stages if s.get("final_output_type") == "audio"}
    for x in sorted(off & set(ups)):
        edges = [f"{u} -> {x}" for u in ups[x] if u not in off and x not in audio]
        edges += [f"{x} -> {d}" for d, us in ups.items() if x in us and d not in off]
        if edges:
            group, todo = {x}, [x]      # the stages x exchanges pieces with, directly or through others
            while todo:
                n = todo.pop()
                for m in [*ups.get(n, []), *(d for d, us in ups.items() if n in us)]:
                    if m not in group:
                        group.add(m)
                        todo.append(m)
            raise ConfigError(f"{source}: stages[{x}].async_chunk: false, but its edge(s) {', '.join(edges)} stay "
                              "chunked at the other end: vllm-omni runs an edge chunked or whole at both ends "
                              "(it refuses this too); set async_chunk: false on stage(s) "
                              f"{', '.join(map(str, sorted(group - off)))} as well, or pipeline-wide (the stage "
                              "that makes audio may opt out alone: it decodes each utterance whole)")
    return off


def _check_whole_decode(stage: dict[str, Any]) -> None:
    from omni.engines.factory import accepted_args     # only here: it imports the engines

    accepted = accepted_args(str(stage.get("engine")))
    if accepted is not None and "stream" not in accepted:
        raise ConfigError(f"async_chunk: false (--no-async-chunk): stage {stage.get('stage_id')}'s engine "
                          f"{stage.get('engine')} has no whole-utterance decode (it makes audio as its input comes)")


def _edge_stage(edge: str, prefix: str, where: str) -> int:
    n = ascii_int(edge[len(prefix):]) if edge.startswith(prefix) else None
    if n is None:
        raise ConfigError(f"{where}: {edge!r} must be {prefix}N (N a stage id)")
    return n


def stage_runtime(value: Any, where: str) -> dict[str, Any]:
    """A stage's `runtime:` mapping (new schema and legacy stage_args alike) as the stage keys it stands for."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "devices":
            out["devices"] = v          # checked with the stage's own (config_stage_checks.normalise_devices)
        elif key in ("num_replicas", "env"):
            out[key] = v
        elif key == "max_batch_size":
            out["engine_args"] = {"max_num_seqs": v}
        elif key == "process" and v is True:
            pass                    # every omni stage is its own process
        else:
            raise ConfigError(f"{where}.{key}: {v!r} is not supported (omni reads devices, num_replicas, env, "
                              "max_batch_size and process: true)")
    return out
