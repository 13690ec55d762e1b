"""vllm-omni's own `serve` options (its OmniConfig group) on `omni serve`.

Parsed with the engine flags (omni/engine_flags.py), they would be spread over the stages and refused
as "no stage takes it". `take` turns those with a meaning in omni into omni's settings first:
  --init-timeout S, --stage-init-timeout S   the start-up deadline (omni starts the stages together:
                                             one bound for the whole start-up)
  --omni-heartbeat-timeout S                 the master's lease: a replica silent this long is dead
  --omni-lb-policy least-queue-length        what omni's router does (random, round-robin: refused)
  --worker-backend multi_process             what omni does (ray, --ray-address: refused)
  --log-stats, --shm-threshold-bytes, --replica-id
                                             no-ops here, each named with what omni does instead
Any other vllm-omni option that no stage's engine takes is refused as vllm-omni's (`refusal`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from omni.errors import ConfigError

NO_OPS = {
    "log_stats": "omni's figures are always on /metrics and in `omni status`",
    "shm_threshold_bytes": "omni picks each tensor's carrier itself (shared memory, CUDA IPC, TCP, NCCL)",
    "replica_id": "deprecated in vllm-omni too: the master assigns replica ids",
}
# The rest of vllm-omni's serve options, by what they are for: refused by name where no engine takes them.
# Keyed by every spelling as parse_extra_flags reads it (--dlo-no-use-allgather: dlo_no_use_allgather), not by
# argparse dest; a --no-X of its BooleanOptionalAction flags is X false (NEGATED); -dac is omni.cli.SHORT_FLAGS'.
OTHERS = {
    "diffusion": ("num_gpus", "model_class_name", "diffusion_load_format", "lora_path", "lora_backend",
                  "lora_scale", "diffusion_compile_granularity", "diffusion_compile_dynamic", "fa_deterministic",
                  "diffusers_load_kwargs", "diffusers_call_kwargs", "custom_pipeline_args", "ulysses_degree",
                  "usp", "ulysses_mode", "ulysses_a2a_permute", "ring_degree", "ring", "allgather_degree",
                  "diffusion_quantization_config", "force_cutlass_fp8", "use_hsdp", "hsdp_shard_size",
                  "hsdp_replicate_size", "diffusion_attention_backend", "fastvideo_vsa_topk",
                  "diffusion_attention_config", "cache_backend", "cache_config", "video_output_transport",
                  "enable_cache_dit_summary", "step_execution", "request_batch_max_wait_ms", "vae_use_slicing",
                  "vae_use_tiling", "disable_multithread_weight_load", "enable_broadcast_weight_load",
                  "num_weight_load_threads", "diffusion_offload_config", "enable_cpu_offload",
                  "enable_layerwise_offload", "enable_distributed_layerwise_offload", "dlo_use_allgather",
                  "dlo_no_use_allgather", "dlo_resident_layers", "host_weight_runtime_mode", "host_weight_runtime_root",
                  "dlo_host_registration_limit_gib", "boundary_ratio", "flow_shift", "diffusion_kv_cache_dtype",
                  "diffusion_kv_cache_skip_steps", "diffusion_kv_cache_skip_layers", "cfg_parallel_size",
                  "vae_patch_parallel_size", "text_encoder_tp_size", "vae_parallel_mode",
                  "default_sampling_params", "max_generated_image_size", "diffusion_streaming_output",
                  "enable_diffusion_pipeline_profiler", "auxiliary_text_encoder"),
    "speech": ("task_type", "forced_aligner", "forced_aligner_config", "forced_aligner_device",
               "tts_max_instructions_length"),
    "orchestrator": ("strategy_config", "batch_timeout", "log_file", "enable_ar_profiler", "enable_orch_monitor",
                     "no_guardrails", "guardrails", "robot_openpi_idle_timeout"),
}
_KIND = {name: kind for kind, names in OTHERS.items() for name in names}
NEGATED = ("guardrails", "diffusion_compile_dynamic", "ulysses_a2a_permute")   # vllm-omni's --no-X forms


@dataclass
class Orchestration:
    """What vllm-omni's options set in omni (None: the deploy config's value)."""
    startup_timeout_s: float | None = None
    lease_ttl_s: float | None = None


def _seconds(flag: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--{flag}: expected a number of seconds > 0, got {value!r}")
    return float(value)


def take(flags: dict[str, Any]) -> Orchestration:
    """Remove vllm-omni's orchestration options from the parsed extra flags; what they set in omni."""
    out = Orchestration()
    for key in ("stage_init_timeout", "init_timeout"):          # the whole start-up's bound wins
        if key in flags:
            out.startup_timeout_s = _seconds(key.replace("_", "-"), flags.pop(key))
    if "omni_heartbeat_timeout" in flags:
        out.lease_ttl_s = _seconds("omni-heartbeat-timeout", flags.pop("omni_heartbeat_timeout"))
    policy = flags.pop("omni_lb_policy", "least-queue-length")
    if policy != "least-queue-length":
        raise ConfigError(f"--omni-lb-policy {policy}: omni routes each request to the least loaded replica that "
                          "can take it (least-queue-length: queued and in-flight work, recent failures); "
                          "random and round-robin are not offered")
    backend = flags.pop("worker_backend", "multi_process")
    if backend != "multi_process":
        raise ConfigError(f"--worker-backend {backend}: omni runs without Ray: each stage replica is its own "
                          "process (multi_process)")
    if "ray_address" in flags:
        raise ConfigError("--ray-address: omni runs without Ray; stages on other hosts join with "
                          "`omni serve MODEL --stage-id K --headless --omni-master-address A --omni-master-port P`")
    for key, what in NO_OPS.items():
        if key in flags:
            print(f"omni: --{key.replace('_', '-')}: ignored: {what}", file=sys.stderr, flush=True)
            del flags[key]
    return out


WHY = {"diffusion": "omni's image and video stages take their settings from the deploy YAML (--deploy-config, "
                     "--stage-overrides) and each request",
       "speech": "omni's speech stages have no such mode",
       "orchestrator": "omni has no such setting"}


def refusal(key: str, value: Any = None, typed: str | None = None) -> str | None:
    """Why a vllm-omni option no stage's engine takes is not there, or None (not one of vllm-omni's), naming it
    `typed` (the flag as typed) where given; else `value` False: given as --no-X (vllm-omni has only
    --no-guardrails, not --guardrails)."""
    kind = _KIND.get(key)
    if kind is None:
        return None
    negated = key in NEGATED and (value is False or key == "guardrails")
    flag = typed or f"--{'no-' if negated else ''}{key.replace('_', '-')}"
    why = "omni's processes log to stderr (redirect it)" if key == "log_file" else WHY[kind]
    return f"{flag}: vllm-omni's {kind} option, not supported: {why}"


def head_only(o: Orchestration) -> None:
    """A headless stage hosts no master: its lease is the head's (as vllm-omni consults it on the head only)."""
    if o.lease_ttl_s is not None:
        print("omni: --omni-heartbeat-timeout: ignored on a headless stage: the head's master holds the leases",
              file=sys.stderr, flush=True)
