#!/usr/bin/env bash
# The one prepared device check (../shared/GPU.md): omni's `cuda` tests and the real-size speech-stage
# benchmarks, each under its own time limit, outputs under $OUT (the device tool brings them back).
# Here: `make gpu-wheels` (the wheels the GPU machine lacks, into .whl/). There, from the repo root,
# with .whl carried:  bash benchmarks/gpu_check.sh [STEP...]   (no STEP: all, in the order below;
# a step that overruns its limit is cut and the rest still run). The limits add up to 13 minutes and
# one device call may last 10, so run it as two calls, back to back (the machine stays warm):
#   bash benchmarks/gpu_check.sh frame cuda_tests
#   bash benchmarks/gpu_check.sh qwen3_stages qwen25_stages token2wav transport
set -uo pipefail
for s in "$@"; do
  case $s in frame|cuda_tests|transport|qwen3_stages|qwen25_stages|token2wav) ;;
    *) echo "gpu_check: no step '$s' (steps: frame cuda_tests transport qwen3_stages qwen25_stages token2wav)"; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/omni-gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_check: installing .whl/*.whl failed (run 'make gpu-wheels' here and carry .whl)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

WANT=" $* "
step() {    # step NAME SECONDS CMD...: CMD's output to $OUT/NAME.txt, its tail to the console
  local name=$1 limit=$2
  shift 2
  [[ "$WANT" == "  " || "$WANT" == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "exit $?" >> "$OUT/$name.txt"
  tail -n 25 "$OUT/$name.txt"
}

# One real-size Qwen3 frame taken apart: graph replay vs launched op by op, kernels per frame and
# the GPU's busy time in them (is the frame bound by kernel count or by the GPU's work?).
step frame 90 python3 benchmarks/talker_frame.py --real-size --device cuda --batch 1,16 --json
# The engine tests that run on both devices (only these files: the others import the HTTP stack);
# the talker modules' `cuda` tests are the graphed path against transformers' codes. On CPU all of
# these ran on the emulated device (tests/unit/fake_cuda.py) first.
step cuda_tests 300 python3 -m pytest -q -p no:cacheprovider -m cuda -o addopts="" \
  tests/unit/test_qwen3_static.py tests/unit/test_streamed_vocoder.py tests/unit/test_qwen3_code2wav.py \
  tests/unit/test_qwen25_token2wav.py tests/unit/test_cuda_ipc.py tests/unit/test_qwen3_talker.py \
  tests/unit/test_qwen25_omni.py
step transport 90 python3 benchmarks/transport.py --device cuda --json
step qwen3_stages 150 python3 benchmarks/qwen3_stages.py --real-size --device cuda --streams 1,4,16,64 --rounds 2 --json
step qwen25_stages 90 python3 benchmarks/qwen3_stages.py --model qwen25 --real-size --device cuda --streams 1,16 --rounds 2 --json
step token2wav 60 python3 benchmarks/token2wav_stream.py --real-size --device cuda --codes 250 --runs 2 --json
