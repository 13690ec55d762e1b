"""`limit_mm_per_prompt` (vLLM's engine arg) as omni reads it, the same way vLLM does.

vLLM takes a count per modality or a mapping with `count` (and profiling sizes): {"audio": 2} or
{"audio": {"count": 2, "length": 16000}}; a modality left out, or a mapping without `count`, is 999
(MultiModalConfig.get_limit_per_prompt). omni's defaults (audio 1, image 0, video 0) stay under what a
config sets (`merged`), so {"audio": 3} does not turn images and video on at 999: omni's frontend takes
no image or video input, and vLLM would profile a vision tower for them. A count above 0 for image or
video is refused at load (`check`), so --dry-run refuses it too. The frontend refuses extra audio parts
before decoding them by the count each thinker replica's vLLM read and registered (capabilities audio_limit).
"""

from __future__ import annotations

from typing import Any, Callable

from omni.errors import ConfigError

KEY = "limit_mm_per_prompt"
DEFAULT_MM_LIMITS = {"audio": 1, "image": 0, "video": 0}
UNSET = 999     # vLLM's count for a modality the limits leave out
NOT_TAKEN = ("image", "video")


def count(value: Any) -> int:
    """One modality's count, as vLLM reads an int or a mapping of options."""
    if isinstance(value, dict):
        return value.get("count", UNSET)
    return value


def merged(limits: dict[str, Any] | None, modalities: set[str] | None = None) -> dict[str, Any]:
    """`limits` over omni's defaults (those of `modalities`; None: all of them)."""
    base = {k: v for k, v in DEFAULT_MM_LIMITS.items() if modalities is None or k in modalities}
    return {**base, **(limits or {})}


def check(args: dict[str, Any], name: Callable[[str], str]) -> None:
    """`args`' limit_mm_per_prompt, if set: a mapping of modality -> count >= 0 (or vLLM's options
    mapping), image and video at 0; `name(KEY)` names it (the flag, or the YAML key path)."""
    limits = args.get(KEY)
    if limits is None:
        return
    where = name(KEY)
    if not isinstance(limits, dict):
        raise ConfigError(f"{where} must be a mapping of modality -> count, e.g. {{\"audio\": 2}}, got {limits!r}")
    for modality, value in limits.items():
        n = count(value)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"{where}.{modality} must be a count >= 0 or a mapping with one "
                              f"({{\"count\": 2}}), got {value!r}")
        if modality in NOT_TAKEN and n > 0:
            raise ConfigError(f"{where}.{modality}: {n} is not supported: omni takes no {modality} input "
                              f"(the API refuses {modality}_url parts); set it to 0 or leave it out")


# One sentence per check, said alike by the frontend (which checks first), the router and the vLLM stage
# (the backstop for a request that reached it some other way).
def too_many_audios(n: int, limit: int, where: str = "") -> str:
    """`n` audio parts past a limit_mm_per_prompt of `limit` (vLLM's own words first); `where`: whose limit."""
    return f"At most {limit} audio(s) may be provided in one prompt{where}; this one has {n} (limit_mm_per_prompt)"


def placeholders_off(kind: str, found: int, parts: int, token: str) -> str:
    """A prompt whose `kind` placeholders (`token`) are not one per part of that kind."""
    return f"the prompt holds {found} {kind} placeholder(s) ({token}) for {parts} {kind} part(s)"
