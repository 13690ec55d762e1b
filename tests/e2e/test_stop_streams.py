"""Ctrl-C on `omni serve` with an SSE stream open: the stream ends with a 'server shutting down' error
event and [DONE] within the frontend's grace (5 s), not cut mid-body. One real `omni serve` (SmolLM2 on
the torch engine) and a long completion."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.e2e.harness import REPO, OmniProcess
from tests.e2e.test_faults import model_path

pytestmark = [pytest.mark.e2e]


def test_ctrl_c_ends_an_open_sse_stream_with_an_error_event_and_done():
    p = OmniProcess("serve", model_path(), "--deploy-config", str(REPO / "deploy" / "single-stage-lm.yaml"),
                    "--port", "0", "--served-model-name", "smol",
                    "--stage-overrides", json.dumps({"0": {"max_model_len": 8192}}))
    try:
        url = p.http(300)
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": True, "stream": True}
        events, t_stop = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if t_stop is None:
                    os.killpg(p.proc.pid, signal.SIGINT)   # Ctrl-C, as a terminal sends it
                    t_stop = time.monotonic()
        took = time.monotonic() - t_stop
    finally:
        p.stop()
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down", events[-3:]
    assert took < 8, took
