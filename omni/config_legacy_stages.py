"""vllm-omni's legacy stage configs (`stage_args:`, its --stage-configs-path), read as a deploy overlay
in omni's shape (config_vllm_omni.translate hands them here first), and the topology they state checked
against omni's pipeline after the merge (config.load). Apart from config_vllm_omni.py, which reads
vllm-omni's current deploy schema; the top-level `runtime:` block is omni/config_legacy_runtime.py."""

from __future__ import annotations

from typing import Any

from omni.config_legacy_runtime import apply_runtime
from omni.config_vllm_omni import note, stage_runtime
from omni.errors import ConfigError

# Each stage_args entry names vllm-omni's classes for the stage; omni runs its own engine and processor
# for it, so these are named and dropped.
LEGACY_INTERNALS = ("model_arch", "worker_cls", "scheduler_cls", "engine_output_type", "hf_config_name",
                    "custom_process_next_stage_input_func", "stage_type", "is_comprehension", "detokenize")
# Checked against omni's pipeline after the merge (config.load), then removed.
LEGACY_ROLES = "legacy_stage_roles"
# omni's names of the stages vllm-omni's legacy files call by another (Qwen2.5's code2wav is token2wav).
STAGE_NAMES = {"thinker": ("thinker",), "talker": ("talker",), "code2wav": ("code2wav", "token2wav")}


def from_stage_args(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A legacy stage config (`stage_args`) as a deploy overlay: runtime.devices -> devices,
    runtime.max_batch_size -> max_num_seqs, engine_args and default_sampling_params as they are; the
    topology it states (model_stage, engine_input_source, final_output) must be omni's pipeline's."""
    unknown = sorted(set(data) - {"stage_args", "async_chunk", "runtime"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(unknown)} in a stage config "
                          "(it has stage_args, async_chunk and runtime)")
    entries = data["stage_args"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{source}: stage_args must be a list of stages")
    out: dict[str, Any] = {k: v for k, v in data.items() if k not in ("stage_args", "runtime")}
    stages, roles, dropped = [], {}, set()
    for e in entries:
        sid = e.get("stage_id")
        here = f"{source}: stage_args[stage_id {sid}]"
        if not isinstance(sid, int):
            raise ConfigError(f"{source}: every stage_args entry needs an integer stage_id")
        stage, role = {"stage_id": sid}, {}
        for key, value in e.items():
            if key == "runtime":
                for k, v in stage_runtime(value, f"{here}.runtime").items():
                    stage[k] = {**v, **stage.get(k, {})} if isinstance(v, dict) else v   # engine_args win
            elif key == "engine_args":
                if not isinstance(value, dict):
                    raise ConfigError(f"{here}.engine_args must be a mapping")
                args = dict(value)
                if "model_stage" in args:
                    role["model_stage"] = args.pop("model_stage")
                dropped |= {k for k in LEGACY_INTERNALS if args.pop(k, None) is not None}
                stage["engine_args"] = {**stage.get("engine_args", {}), **args}
            elif key == "engine_input_source":
                role["inputs"] = value
            elif key in ("final_output", "final_output_type"):
                role[key] = value
            elif key == "custom_process_input_func":
                if not str(value).startswith("vllm_omni."):
                    raise ConfigError(f"{here}.custom_process_input_func: {value!r} is not supported: omni runs "
                                      "its own processor for each stage of its pipelines")
                dropped.add(key)
            elif key == "default_sampling_params":
                stage[key] = value
            elif key in LEGACY_INTERNALS:
                dropped.add(key)
            elif key != "stage_id":
                raise ConfigError(f"{here}: unknown key {key!r}")
        if "default_sampling_params" in stage:
            stage["default_sampling_params"] = _legacy_sampling(stage["default_sampling_params"], dropped)
        stages.append(stage)
        roles[sid] = role
    if dropped:
        note(source, f"{', '.join(sorted(dropped))}: vllm-omni's own classes and output kinds, ignored "
                     "(omni runs its own engine and processor for each stage)")
    if "runtime" in data:
        edges = {(i, sid) for sid, role in roles.items() if isinstance(role.get("inputs"), list)
                 for i in role["inputs"] if isinstance(i, int)}
        runtime_dropped = apply_runtime(data["runtime"], stages, edges, source)
        if runtime_dropped:
            note(source, f"runtime: {', '.join(runtime_dropped)}: dropped")
    out["stages"] = stages
    out[LEGACY_ROLES] = roles
    return out


def _legacy_sampling(value: Any, dropped: set) -> Any:
    """`detokenize` is what omni does anyway (text out of the thinker, codes and audio out of the others)."""
    if not isinstance(value, dict):
        return value                # validation names it
    value = dict(value)
    if value.pop("detokenize", None) is not None:
        dropped.add("detokenize")
    return value


def check_roles(stages: list, roles: dict[int, dict], source: str) -> None:
    """A legacy stage config states the topology; it must be omni's pipeline for the model."""
    ours = {s.get("stage_id"): s for s in stages if isinstance(s, dict)}
    if sorted(roles) != sorted(ours):
        names = ", ".join(f"{i} {ours[i].get('name', '')}".strip() for i in sorted(ours))
        raise ConfigError(f"{source}: stage_args lists stages {sorted(roles)}; omni's pipeline for this model has "
                          f"{names}: list every one (a thinker alone: --deploy-config NAME-thinker-only)")
    for sid, role in roles.items():
        s, here = ours[sid], f"{source}: stage_args[stage_id {sid}]"
        name = s.get("name", "")
        want = role.get("model_stage")
        if want in STAGE_NAMES and name not in STAGE_NAMES[want]:
            raise ConfigError(f"{here}.engine_args.model_stage: {want!r}, but stage {sid} of omni's pipeline is "
                              f"{name!r}")
        upstream = [i for i in s.get("inputs", ["prompt"]) if isinstance(i, int)]
        if list(role.get("inputs") or []) != upstream:
            raise ConfigError(f"{here}.engine_input_source: {role.get('inputs') or []}, but omni's {name or sid} "
                              f"takes {upstream or 'the prompt'}")
        final = bool(role.get("final_output", False))
        if final != bool(s.get("final_output", False)) or \
                (final and role.get("final_output_type") != s.get("final_output_type")):
            raise ConfigError(f"{here}: final_output {final} {role.get('final_output_type')!r}, but omni's "
                              f"{name or sid} has {bool(s.get('final_output'))} {s.get('final_output_type')!r}")
