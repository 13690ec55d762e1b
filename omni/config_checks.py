"""Range checks of the deploy config's numbers (omni/config.py validates the rest).

`v <= 0` is False for NaN, so every bound here is written to refuse NaN (and inf where a
finite number is meant): a NaN timeout fires at once or never."""

from __future__ import annotations

import math
from typing import Any

from omni.errors import ConfigError

# Seconds the pipeline waits on something; each must be a finite number > 0.
PIPELINE_SECONDS = ("request_timeout_s", "startup_timeout_s", "lease_ttl_s", "stall_timeout_s")


def check_pipeline(pipeline: Any, source: str) -> None:
    for key in PIPELINE_SECONDS:
        v = getattr(pipeline, key)
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{source}: pipeline.{key} must be > 0 and finite (seconds), got {v}")
