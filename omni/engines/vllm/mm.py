"""Multi-modal requests for the vLLM engine: audio in (Qwen3-Omni's thinker), prompt ids out.

The request contract (see VllmEngine's docstring for the whole of it):
- `prompt_token_ids` hold, per audio, one `<|audio_start|><|audio_pad|><|audio_end|>`: a single
  pad token that vLLM's processor expands to the audio tower's output length. Token ids (not
  text) because tokenization stays in the frontends, as for text-only prompts.
- `tensors["audio_0"]`, `tensors["audio_1"]`, ...: float32 mono waveforms at 16 kHz, 1-D, in the
  order of their placeholders. Images and video are refused by name.
- `request.emit_prompt_ids`: the first output carries `tensors["prompt_token_ids"]` (int64), the
  prompt as vLLM expanded it (the talker needs the audio positions).
- With `engine_args.mm_hidden_layer`, the first output of a prompt with audio also carries
  `tensors["mm_hidden"]` (hidden.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni import mm_limits
from omni.engines.base import EngineError, EngineRequest

AUDIO_SAMPLE_RATE = 16000
AUDIO_KEY = re.compile(r"audio_(\d+)$")
# Longer audio is refused before it reaches the feature extractor.
MAX_AUDIO_SECONDS = 600


@dataclass(frozen=True)
class MmTokens:
    """The placeholder token ids of a multi-modal model (None: the model has no such input)."""

    audio: int | None = None
    image: int | None = None
    video: int | None = None

    def modalities(self) -> set[str]:
        return {k for k in ("audio", "image", "video") if getattr(self, k) is not None}

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MmTokens:
        c = getattr(hf_config, "thinker_config", hf_config)
        return cls(audio=getattr(c, "audio_token_id", None), image=getattr(c, "image_token_id", None),
                   video=getattr(c, "video_token_id", None))


def default_limits(vllm_args: dict[str, Any], supported: set[str]) -> None:
    """limit_mm_per_prompt as the stage config set it, over omni's defaults for the modalities the model has
    (audio only: images and video need a torchvision with kernels, which a CPU install lacks)."""
    vllm_args["limit_mm_per_prompt"] = mm_limits.merged(vllm_args.get("limit_mm_per_prompt"), supported)


def stage_limits(vllm_config: Any, supported: set[str]) -> dict[str, int]:
    """Each modality's count as vLLM reads limit_mm_per_prompt (a count or options mapping; 999 when unset)."""
    mm = vllm_config.model_config.multimodal_config
    return {m: mm.get_limit_per_prompt(m) for m in supported}


def audio_items(request: EngineRequest) -> list[np.ndarray]:
    """The request's waveforms in order, checked; EngineError naming what is wrong."""
    rid = request.request_id
    found: dict[int, Any] = {}
    for key, t in request.tensors.items():
        m = AUDIO_KEY.match(key)
        if m is None:
            what = "images and video are not supported by this stage" if key.startswith(("image", "video")) \
                else "it takes audio_0, audio_1, ... (float32 waveforms at 16 kHz)"
            raise EngineError(f"request {rid!r}: input tensor {key!r} refused: {what}")
        found[int(m.group(1))] = t
    if sorted(found) != list(range(len(found))):
        raise EngineError(f"request {rid!r}: audio tensors must be numbered audio_0..audio_{len(found) - 1}, "
                          f"got {sorted(request.tensors)}")
    out = []
    for i in range(len(found)):
        a = found[i]
        a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
        if a.ndim != 1 or a.size == 0:
            raise EngineError(f"request {rid!r}: audio_{i} must be a 1-D mono waveform, got shape {list(a.shape)}")
        if a.size > MAX_AUDIO_SECONDS * AUDIO_SAMPLE_RATE:
            raise EngineError(f"request {rid!r}: audio_{i} is longer than {MAX_AUDIO_SECONDS} s")
        a = a.astype(np.float32, copy=False)
        if not np.isfinite(a).all():
            raise EngineError(f"request {rid!r}: audio_{i} has non-finite samples")
        out.append(a)
    return out


def build_prompt(request: EngineRequest, prompt: list[int], tokens: MmTokens,
                 limits: dict[str, int]) -> tuple[dict[str, Any], int]:
    """(vLLM prompt dict, number of audios): token ids plus the audios as multi-modal data."""
    rid = request.request_id
    audios = audio_items(request) if request.tensors else []
    for name in ("image", "video"):
        tid = getattr(tokens, name)
        if tid is not None and tid in prompt:
            off = mm_limits.placeholders_off(name, prompt.count(tid), 0, f"token {tid}")
            raise EngineError(f"request {rid!r}: {off}; images and video are not supported by this stage")
    n_pad = prompt.count(tokens.audio) if tokens.audio is not None else 0
    if audios and tokens.audio is None:
        raise EngineError(f"request {rid!r}: this model takes no audio input")
    if n_pad != len(audios):
        off = mm_limits.placeholders_off("audio", n_pad, len(audios), f"token {tokens.audio}")
        raise EngineError(f"request {rid!r}: {off}; put one <|audio_start|><|audio_pad|><|audio_end|> per audio")
    if len(audios) > limits.get("audio", 0):
        over = mm_limits.too_many_audios(len(audios), limits.get("audio", 0), " to this stage")
        raise EngineError(f"request {rid!r}: {over}")
    out: dict[str, Any] = {"prompt_token_ids": prompt}
    if audios:
        out["multi_modal_data"] = {"audio": [(a, AUDIO_SAMPLE_RATE) for a in audios]}
    return out, len(audios)


def enable_hidden_capture(label: str, layer: Any, hf_config: Any, vllm_args: dict[str, Any],
                          rows_layer: Any = None):
    """Turn on hidden-state capture: `layer` at multi-modal prompt positions (an int, or "talker": the
    talker's accept_hidden_layer), `rows_layer` for every fed token (an int in [0, n_layers], or
    "last" = n_layers: the last layer's output before the final norm). Returns the engine's
    HiddenStatesReader, or None when neither is set."""
    if layer is None and rows_layer is None:
        return None
    from omni.errors import ConfigError

    if layer == "talker":
        layer = getattr(getattr(hf_config, "talker_config", None), "accept_hidden_layer", None)
        if layer is None:
            raise ConfigError(f"{label}: engine_args.mm_hidden_layer 'talker': the model has no "
                              "talker_config.accept_hidden_layer")
    c = getattr(hf_config, "thinker_config", hf_config)
    n_layers = getattr(getattr(c, "text_config", c), "num_hidden_layers", None)
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)
                              or not (n_layers is None or 0 <= layer < n_layers)):
        raise ConfigError(f"{label}: engine_args.mm_hidden_layer must be 'talker' or a layer index in "
                          f"[0, {n_layers}), got {layer!r}")
    if rows_layer == "last" and n_layers is not None:
        rows_layer = n_layers
    if rows_layer is not None and (isinstance(rows_layer, bool) or not isinstance(rows_layer, int)
                                   or not (n_layers is None or 0 <= rows_layer <= n_layers)):
        raise ConfigError(f"{label}: engine_args.hidden_rows_layer must be 'last' or a layer index in "
                          f"[0, {n_layers}], got {rows_layer!r}")
    flag = "mm_hidden_layer" if rows_layer is None else "hidden_rows_layer"
    taken = [k for k in ("speculative_config", "kv_transfer_config") if vllm_args.get(k) is not None]
    if taken:
        raise ConfigError(f"{label}: engine_args.{flag} uses vLLM's {' and '.join(taken)}; "
                          f"remove them or {flag}")
    from omni.engines.vllm import hidden as vllm_hidden

    reader = vllm_hidden.HiddenStatesReader()
    vllm_args.update(vllm_hidden.engine_args(layer, rows_layer, str(reader.dir)))
    return reader


def hidden_request_args(file_name: str | None, rows_stem: str | None = None) -> dict[str, Any]:
    from omni.engines.vllm import hidden as vllm_hidden

    params = {}
    if file_name is not None:
        params[vllm_hidden.PARAM] = file_name
    if rows_stem is not None:
        params[vllm_hidden.ROWS_PARAM] = rows_stem
    return {"kv_transfer_params": params}
