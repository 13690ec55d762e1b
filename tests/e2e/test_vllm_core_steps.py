"""A vLLM stage's long prefill is progress, not a stall (pipeline.loop_stall_s): vLLM's EngineCore sends
nothing for a chunk of a prefill, so only its step count (omni/engines/vllm/core_steps.py) says it moves.
The engine is built in a child process: a spawned EngineCore needs a __main__ guard, and a stage's
process is what builds one."""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile

import pytest

from tests.e2e.harness import REPO
from tests.e2e.test_vllm_stage import HAVE_VLLM, MODEL, vllm_env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")]

CHUNK, PROMPT = 16, 200

PREFILL = r"""
import sys, time

from omni.config import DeployConfig, StageConfig
from omni.engines.base import EngineRequest, SamplingParams
from omni.engines.factory import build_engine
from omni.models.resolve import resolve_model


def main():
    chunk, prompt = int(sys.argv[1]), int(sys.argv[2])
    stage = StageConfig(stage_id=0, engine="vllm", engine_args={
        "dtype": "float32", "max_num_seqs": 2, "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 1024,
        "enable_chunked_prefill": True, "max_num_batched_tokens": chunk, "num_threads": 1})
    engine = build_engine(DeployConfig(model=resolve_model(sys.argv[3]), stages=(stage,)), stage)
    marks = []
    engine.progress_hook = lambda: marks.append(1)
    try:
        engine.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(100, 100 + prompt)),
                                         sampling=SamplingParams(max_tokens=1, temperature=0.0)))
        deadline, outputs = time.monotonic() + 300, []
        while not outputs and time.monotonic() < deadline:
            outputs = engine.step()
        print(f"MARKS {len(marks)} OUTPUT {len(outputs)}", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
"""


def test_each_prefill_chunk_of_the_engine_core_marks_progress_before_any_output():
    before = set(glob.glob(f"{tempfile.gettempdir()}/omni-core-steps-*"))
    out = subprocess.run([sys.executable, "-c", PREFILL, str(CHUNK), str(PROMPT), MODEL], cwd=REPO,
                         env=vllm_env(), capture_output=True, text=True, timeout=400)
    line = [x for x in out.stdout.splitlines() if x.startswith("MARKS ")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    _, marks, _, outputs = line[0].split()
    # 200 prompt tokens in chunks of 16: 13 core steps, all but the last without output.
    assert int(outputs) == 1 and int(marks) >= PROMPT // CHUNK - 1, line
    assert set(glob.glob(f"{tempfile.gettempdir()}/omni-core-steps-*")) <= before   # no file left
