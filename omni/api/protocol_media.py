"""Request bodies of the speech, image, video and voice routes (omni/api/protocol.py has the
text routes' and the shared decoding; it re-exports these, so the routes name them P.*)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from omni.api.errors import bad_request
from omni.api.refused import refused as _refused
from omni.config_checks import MAX_SPEECH_CHARS
SPEED_MIN, SPEED_MAX = 0.25, 4.0     # OpenAI's range for speech's speed
Speed = Annotated[float, msgspec.Meta(ge=SPEED_MIN, le=SPEED_MAX)]
# A pattern's end: msgspec checks patterns with re.search, where `$` also matches before a final "\n" ("joe\n"
# passed as joe's name); `\Z` would fix that but is no JSON Schema (ECMA) regex, and the schemas carry these.
END = r"$(?!\n)"
VoiceName = Annotated[str, msgspec.Meta(max_length=128)]


class VoiceId(msgspec.Struct):
    """OpenAI's voice object: `{"id": "..."}`."""
    id: VoiceName


Voice = VoiceName | VoiceId | None     # OpenAI's str | {"id": ...}; None: the default voice (chat and speech)


# Speech's response_format (OpenAI's six; vllm-omni's five are among them) and chat's audio.format (OpenAI's,
# pcm16 for raw s16le, and aac). A str with the choices in the schema, so that speech.py / text.py refuse
# another naming the field and the choices, not msgspec's "Invalid enum value".
SPEECH_FORMATS = ("wav", "pcm", "mp3", "flac", "opus", "aac")
CHAT_AUDIO_FORMATS = ("wav", "pcm16", "mp3", "flac", "opus", "aac")


def _audio_format(choices: tuple[str, ...]) -> Any:
    return Annotated[str, msgspec.Meta(max_length=16, extra_json_schema={"enum": list(choices)})]


SpeechFormat = _audio_format(SPEECH_FORMATS)
ChatAudioFormat = _audio_format(CHAT_AUDIO_FORMATS)


def voice_name(voice: Voice) -> str | None:
    return voice.id if isinstance(voice, VoiceId) else voice


class SpeechRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's /v1/audio/speech and vllm-omni's names for the same. A field not here is refused by name
    (vllm-omni's x_vector_only_mode, initial_codec_chunk_frames ...: no stage here would honour them)."""
    # Something to say (not only whitespace) and no NUL: checked in speech.py for the message.
    input: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SPEECH_CHARS,
                                       extra_json_schema={"pattern": r"^[^\x00]*[^\s\x00][^\x00]*$"})]
    model: str | None = None
    voice: Voice = None
    speaker: VoiceName | None = None            # vllm-omni's name for it
    response_format: SpeechFormat = "wav"   # mp3, flac, opus, aac: omni/audio_encode.py
    speed: Speed | None = 1.0                   # null: 1.0, as vllm-omni takes it
    # OpenAI's / vllm-omni's streaming: "sse" (speech.audio.delta events; `stream: true` alone picks it),
    # "audio" (the raw bytes as made; wav behind a header of unknown length)
    stream: bool = False
    stream_format: Literal["sse", "audio"] | None = None
    # Declared so that they are refused by name with the reason (SPEECH_REFUSED).
    instructions: Annotated[str | None, _refused(["", None])] = None
    language: Annotated[str | None, _refused([None])] = None
    task_type: Annotated[str | None, _refused([None])] = None
    ref_audio: Annotated[str | list | None, _refused([None])] = None
    ref_text: Annotated[str | None, _refused([None])] = None
    sample_rate: Annotated[int | None, _refused([None])] = None
    seed: Annotated[int | None, _refused([None])] = None
    max_new_tokens: Annotated[int | None, _refused([None])] = None


# Why each refused /v1/audio/speech field is not taken (speech.py names the first one set), in
# refused.first_refused's form: unset or "" does nothing.
SPEECH_REFUSED = {name: ([None, ""], why) for name, why in {
    "instructions": "this pipeline's voices take no style instructions",
    "language": "this pipeline's speech stage picks no language",
    "task_type": "vllm-omni's Qwen3-TTS option; this pipeline's speech stage has no tasks",
    "ref_audio": "voice cloning is not supported by this server (/v1/audio/voices makes speed presets of its voices)",
    "ref_text": "voice cloning is not supported by this server (/v1/audio/voices makes speed presets of its voices)",
    "sample_rate": "the audio comes at the model's own rate (the WAV header, X-Sample-Rate)",
    "seed": "this pipeline's speech is not sampled from a seed",
    "max_new_tokens": "the speech ends with its text",
}.items()}


# vllm-omni's TTS fields as its benchmark merges them into a chat body (Seed-TTS rows): a chat naming one is
# refused by name (protocol.check_sampling), never answered in the default voice. Unset or a no-op value passes.
CHAT_SPEECH_REFUSED = {
    **{name: SPEECH_REFUSED[name] for name in ("ref_audio", "ref_text", "task_type", "language", "instructions")},
    "speaker_embedding": ([None, []], "voice cloning is not supported by this server"),
    "x_vector_only_mode": ([None, False], "voice cloning is not supported by this server"),
    "max_new_tokens": ([None], "vllm-omni's TTS limit; here max_tokens / max_completion_tokens bound the text, "
                               "and the speech ends with it"),
    "extra_params": ([None, {}], "vllm-omni's TTS model options reach no stage of this pipeline"),
}


MAX_IMAGE_PROMPT_CHARS = 4000
# "WxH" (ASCII digits: str.isdigit took "²", which int() then refused); images take OpenAI's "auto" too. In the
# schema only: images.parse_size matches it and refuses a malformed size in words (msgspec's message quoted it).
WXH = r"[0-9]{1,5}x[0-9]{1,5}"
ImageSize = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": f"^({WXH}|auto)$"})]
VideoSize = Annotated[str, msgspec.Meta(extra_json_schema={"pattern": f"^{WXH}$"})]


class ImageGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's /v1/images/generations, plus diffusion's own knobs. Unlike the text routes an unknown
    field is refused by name (`quality`, `style`: nothing here would honour them). The deployment's
    bounds (pipeline.images: size multiple, pixels, steps, n) are checked in omni/api/images.py."""
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IMAGE_PROMPT_CHARS)]
    model: str | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None
    size: ImageSize | None = None   # "WxH" or "auto" (the deployment's default_size)
    response_format: Annotated[str, _refused(["b64_json"])] = "b64_json"
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None      # OpenAI's end-user label
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    # Qwen-Image's true classifier-free guidance scale (diffusers' true_cfg_scale); <= 1: none.
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0, le=50.0)] | None = None
    negative_prompt: Annotated[str, msgspec.Meta(max_length=MAX_IMAGE_PROMPT_CHARS)] | None = None
    # vllm-omni's names: true_cfg_scale is what guidance_scale is here (images.py refuses the two differing);
    # output_format: omni encodes PNG only (images.py refuses another by name).
    true_cfg_scale: Annotated[float, msgspec.Meta(ge=0.0, le=50.0)] | None = None
    output_format: Annotated[str | None, _refused([None, "png"])] = None


class VideoCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's POST /v1/videos (JSON or a multipart form), plus vllm-omni's diffusion knobs (width, height,
    num_frames, fps, steps, guidance, negative prompt, seed). An unknown field is refused by name
    (`input_reference`: text-to-video only; `guidance_scale_2`, `boundary_ratio`: fixed by the model).
    The deployment's bounds (pipeline.videos) are checked in omni/api/videos.py."""
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IMAGE_PROMPT_CHARS)]
    model: str | None = None
    size: VideoSize | None = None   # "WxH"
    seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)] | None = None   # OpenAI's ("4"): frames = seconds x fps
    width: Annotated[int, msgspec.Meta(ge=1, le=16384)] | None = None
    height: Annotated[int, msgspec.Meta(ge=1, le=16384)] | None = None
    num_frames: Annotated[int, msgspec.Meta(ge=1, le=100000)] | None = None
    fps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    guidance_scale: Annotated[float, msgspec.Meta(ge=0.0, le=50.0)] | None = None
    negative_prompt: Annotated[str, msgspec.Meta(max_length=MAX_IMAGE_PROMPT_CHARS)] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None


VOICE_NAME = r"^[A-Za-z0-9_-]{1,64}" + END


class VoiceSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=VOICE_NAME)]
    base: str = "joe"
    speed: Speed = 1.0


VOICE_NAME_RE = re.compile(VOICE_NAME)


def check_voice_spec(spec: VoiceSpec, builtin: list[str]) -> None:
    if not VOICE_NAME_RE.match(spec.name):
        raise bad_request(f"voice name `{spec.name}` must be 1-64 letters, digits, '_' or '-'",
                          param="name")
    if spec.base.lower() not in builtin:     # names in any case, as a request's voice
        raise bad_request(f"base voice `{spec.base}` is not a built-in voice ({', '.join(builtin)})",
                          param="base")
    check_speed(spec.speed)


def check_speed(speed: float) -> None:
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise bad_request(f"speed={speed} must be in [{SPEED_MIN}, {SPEED_MAX}]", param="speed")


def preset_speed(speed: float, voice: str, preset: float) -> float:
    """The speed a preset is spoken at: the request's times the preset's, held to the request's own
    range (4 x 4 reached the pipeline as 16, past Piper's 10: a 400 quoting an internal request id)."""
    total = speed * preset
    if not SPEED_MIN <= total <= SPEED_MAX:
        raise bad_request(f"speed={speed} with voice `{voice}` (a preset at speed {preset}) makes {total:g}, outside "
                          f"[{SPEED_MIN}, {SPEED_MAX}]; the speed of a preset and the request's multiply", param="speed")
    return total
