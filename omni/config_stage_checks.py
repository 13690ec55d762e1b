"""Checks of a deploy stage's `devices`, `connectors` and `engine_args` that would otherwise be
taken and do nothing (omni/config.py calls them while it validates the stages).

- `devices`: vllm-omni's forms, "cpu" or GPU indices into the visible devices ("0", "0,1", or
  a YAML integer 0), become the stage's CUDA_VISIBLE_DEVICES (omni.stage.main.select_devices);
  "cuda:0,cuda:1" is read as "0,1". Anything else (a negative or non-integer index, a GPU named
  twice) is refused at load, before any process starts: "cuda:0" used to become
  CUDA_VISIBLE_DEVICES=cuda:0, which hides every GPU.
- `connectors`: keyed by the stage that reads this stage's output (its `inputs` name this stage);
  the orchestrator looks up no other key, so one to the stage itself, an earlier stage or a stage
  that does not read this one is refused, naming the pipeline's edges.
- `engine_args`: EngineArgs fields only vLLM's serving layer reads (omni's frontend tokenizes,
  samples and names the model itself) are refused as `omni serve --tokenizer` ... are
  (omni.vllm_serve_flags): a vllm stage would take them and change nothing.
"""

from __future__ import annotations

from typing import Any

from omni.errors import ConfigError

__all__ = ["SERVING_ONLY_ARGS", "check_connector_edge", "normalise_devices", "normalise_stage_devices",
           "unused_engine_arg"]

DEVICE_FORMS = "'cpu' or GPU indices into the visible GPUs: \"0\", \"0,1\" (or \"cuda:0,cuda:1\")"

_REVISION = "omni loads MODEL as it is on disk: serve a folder holding the revision you want"
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
}
# Engine args only: `omni serve` has the flag of its own.
_ENGINE_ARGS_ONLY = {"served_model_name": "the API's model name is `omni serve --served-model-name`"}


def normalise_devices(value: Any, where: str) -> str:
    """A stage's `devices` as omni keeps it: "cpu", or GPU indices "0,1" (or "", unrestricted)."""
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
        if not (index.isascii() and index.isdigit()):
            raise ConfigError(f"{where}.devices: {token!r} in {value!r} is not a GPU index (a non-negative "
                              f"integer); devices must be {DEVICE_FORMS}")
        if str(int(index)) in out:
            raise ConfigError(f"{where}.devices: {value!r} names GPU {int(index)} twice")
        out.append(str(int(index)))
    if not out:
        raise ConfigError(f"{where}.devices must be {DEVICE_FORMS}, got {value!r}")
    return ",".join(out)


def normalise_stage_devices(data: dict[str, Any], source: str) -> None:
    """Every stage's `devices` in a merged deploy mapping, normalised (before typing): `data` gets
    a new `stages` list, the caller's stage mappings stay as they were."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return
    data["stages"] = [dict(s) if isinstance(s, dict) else s for s in stages]
    for i, stage in enumerate(data["stages"]):
        if isinstance(stage, dict) and "devices" in stage:
            sid = stage.get("stage_id", i)
            stage["devices"] = normalise_devices(stage["devices"], f"{source}: stages[{sid}]")


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
