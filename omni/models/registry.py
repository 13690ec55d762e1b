"""Model families: everything omni knows of a family, in one table.

A family is one package under omni/models/ and one `Family` line below: how a model folder is
recognised (config.json `model_type`; a diffusers folder's model_index.json `_class_name`), its
bundled deploy configs, its stage engines by name, the processors its deploys name, its voices and
the builder of its tiny same-architecture test folder.
omni/engines/factory.py builds engines from here and omni/config.py picks a folder's deploy from
here; docs/architecture.md ("Adding a model family") lists the steps. Nothing here imports a
family's code: entries name it ("module:attribute"), so reading the table stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineSpec:
    cls: str                  # "module:Class"; its keyword-only arguments are the engine_args it takes
    # "module:function(name) -> path" giving what the engine is built on from the stage's `model`
    # (else default_weights, else the pipeline's model): a local model folder by default.
    weights: str = "omni.models.resolve:resolve_model"
    default_weights: str | None = None
    # Takes the torch stage keys (device, num_threads, gpu_memory_utilization): factory.torch_stage_args.
    torch: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    package: str
    # a folder whose config.json `model_type` (a diffusers folder: model_index.json `_class_name`) is one of these
    model_types: tuple[str, ...] = ()
    deploy: str | None = None                # the bundled deploy config such a folder gets
    deploys: tuple[str, ...] = ()            # every bundled deploy config of the family (deploy/)
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    processors: tuple[str, ...] = ()         # "module:function" names its deploys use
    voices: tuple[str, ...] = ()             # its built-in speakers
    tiny: str | None = None                  # "module:function(folder)" writing a tiny folder of the family


VOICE = "omni.models.piper.voice:voice_dir"     # a built-in Piper voice, split once into its two stages

FAMILIES: tuple[Family, ...] = (
    # The default pipeline on CPU: SmolLM2 (any LM engine) -> Piper's VITS split into talker and vocoder.
    Family(
        "smollm2-piper", "omni.models.piper",
        deploys=("smollm2-135m-instruct.yaml", "smollm2-135m-instruct-vllm.yaml"),
        engines={"piper_talker": EngineSpec("omni.models.piper.engines:TalkerEngine", VOICE, "joe", torch=False),
                 "piper_code2wav": EngineSpec("omni.models.piper.engines:Code2WavEngine", VOICE, "joe", torch=False)},
        processors=("omni.models.piper.processors:thinker_to_talker",
                    "omni.models.piper.processors:talker_to_code2wav"),
        voices=("joe",)),
    Family(
        "qwen3-omni", "omni.models.qwen3_omni", model_types=("qwen3_omni_moe",),
        deploy="qwen3-omni-moe.yaml",
        deploys=("qwen3-omni-moe.yaml", "qwen3-omni-moe-thinker-only.yaml", "qwen3-omni-moe-1gpu.yaml"),
        engines={"qwen3_talker": EngineSpec("omni.models.qwen3_omni.talker:Qwen3TalkerEngine"),
                 "qwen3_code2wav": EngineSpec("omni.models.qwen3_omni.code2wav:Qwen3Code2WavEngine")},
        processors=("omni.models.qwen3_omni.processors:thinker_to_talker",
                    "omni.models.qwen3_omni.processors:talker_to_code2wav"),
        voices=("chelsie", "ethan", "aiden"),
        tiny="omni.models.qwen3_omni.tiny:build"),
    Family(
        "qwen2.5-omni", "omni.models.qwen25_omni", model_types=("qwen2_5_omni",),
        deploy="qwen2.5-omni-7b.yaml",
        deploys=("qwen2.5-omni-7b.yaml", "qwen2.5-omni-3b.yaml"),
        engines={"qwen25_talker": EngineSpec("omni.models.qwen25_omni.talker:Qwen25TalkerEngine"),
                 "qwen25_token2wav": EngineSpec("omni.models.qwen25_omni.token2wav:Qwen25Token2WavEngine")},
        processors=("omni.models.qwen25_omni.processors:thinker_to_talker",
                    "omni.models.qwen25_omni.processors:talker_to_token2wav"),
        voices=("chelsie", "ethan"),
        tiny="omni.models.qwen25_omni.tiny:build"),
    # A diffusers folder: model_index.json's `_class_name` stands for config.json's model_type.
    Family(
        "qwen-image", "omni.models.qwen_image", model_types=("QwenImagePipeline",),
        deploy="qwen-image.yaml", deploys=("qwen-image.yaml", "qwen-image-prompt-expand.yaml"),
        engines={"qwen_image": EngineSpec("omni.models.qwen_image.engine:QwenImageEngine")},
        processors=("omni.models.qwen_image.processors:lm_to_dit",),
        tiny="omni.models.qwen_image.tiny:build"),
    Family(
        "wan", "omni.models.wan", model_types=("WanPipeline",),
        deploy="wan2.1-t2v.yaml", deploys=("wan2.1-t2v.yaml",),
        engines={"wan": EngineSpec("omni.models.wan.engine:WanEngine")},
        tiny="omni.models.wan.tiny:build"),
)

# Deploy configs of no family: one LM stage (any folder of another model_type), and LM -> pooler.
GENERIC_DEPLOYS = ("single-stage-lm.yaml", "lm-pooler.yaml")
FOLDER_FALLBACK = "single-stage-lm.yaml"


def family(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no model family {name!r} (known: {', '.join(f.name for f in FAMILIES)})")


def engines() -> dict[str, tuple[Family, EngineSpec]]:
    """Every family's engine name -> (its family, how to build it)."""
    return {name: (f, spec) for f in FAMILIES for name, spec in f.engines.items()}


def folder_deploy(model_type: str) -> str:
    """The bundled deploy config for a model folder of this `model_type` (one LM stage for any other)."""
    for f in FAMILIES:
        if model_type in f.model_types and f.deploy:
            return f.deploy
    return FOLDER_FALLBACK


def family_of_deploy(file_name: str) -> Family | None:
    for f in FAMILIES:
        if file_name in f.deploys:
            return f
    return None
