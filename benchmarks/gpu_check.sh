#!/usr/bin/env bash
# The one prepared device check (docs/benchmarks.md "On a GPU"): the real-size speech-stage benchmarks
# and omni's `cuda` tests, most wanted first, outputs under $OUT (the device tool brings them back).
# Here: `make gpu-wheels` (the wheels the GPU machine lacks, into .whl/). There, from the repo root,
# with .whl carried:
#   GPU_CHECK_SECONDS=420 bash benchmarks/gpu_check.sh [STEP...]
# No STEP: all, in the order below. The whole call keeps to GPU_CHECK_SECONDS (default 420): each step
# runs under its own limit or what is left of the budget, whichever is less, and a step with under
# 30 s left is skipped and named. A session has 15 minutes of device time, the machine's start (1-2
# min) included: the first call with the default budget leaves time for a second call (the steps it
# skipped) or a rerun. Each benchmark also prints its rows to stderr as they finish, so a step cut at
# its limit still leaves figures in $OUT/STEP.txt.
set -uo pipefail
STEPS="qwen3_stages frame cuda_tests qwen25_stages token2wav transport qwen3_wide"
for s in "$@"; do
  [[ " $STEPS " == *" $s "* ]] || { echo "gpu_check: no step '$s' (steps: $STEPS)"; exit 2; }
done
BUDGET=${GPU_CHECK_SECONDS:-420}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check: GPU_CHECK_SECONDS must be a number of seconds, got '$BUDGET'"; exit 2; }
DEADLINE=$((SECONDS + BUDGET))
OUT=${OUT:-/tmp/omni-gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_check: installing .whl/*.whl failed (run 'make gpu-wheels' here and carry .whl)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

WANT=" $* "
live_in_group() {   # the processes of group $1 still running (zombies left to init are not)
  if command -v ps > /dev/null; then
    ps -o pid=,stat= -g "$1" | awk '$2 !~ /^Z/ {print $1}'
  elif kill -0 -- "-$1" 2> /dev/null; then
    echo "process group $1"
  fi
}
step() {    # step NAME SECONDS CMD...: CMD's output to $OUT/NAME.txt, its tail to the console
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  [[ "$WANT" == "  " || "$WANT" == *" $name "* ]] || return 0
  if ((left < 30)); then echo "== $name: skipped (${left}s of the ${BUDGET}s budget left)"; return 0; fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s, ${left}s of the budget left): $*"
  local t0=$SECONDS pid rc
  # Its own session and process group, so nothing it starts outlives it (a test's child process would
  # share the GPU with the next step's timings): at the limit timeout signals the group, KILL 5 s later
  # if TERM is not enough, and whatever is left when the step ends is killed.
  setsid timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  local left tries=0
  left=$(live_in_group "$pid")
  while [[ -n "$left" ]] && ((tries++ < 10)); do    # a helper still exiting (multiprocessing's resource tracker)
    sleep 0.2
    left=$(live_in_group "$pid")
  done
  if [[ -n "$left" ]]; then
    echo "gpu_check: killed what $name left running: "$left >> "$OUT/$name.txt"
  fi
  kill -KILL -- "-$pid" 2>/dev/null
  echo "exit $rc after $((SECONDS - t0))s" >> "$OUT/$name.txt"
  tail -n 25 "$OUT/$name.txt"
}

# The goal's figures: real-size Qwen3 talker + code predictor, eager / static / graphed side by side,
# at 1 and 16 streams (issue 25: <= 8 ms a frame at 1, <= 20 ms a step at 16, first audio <= 100 ms).
step qwen3_stages 150 python3 benchmarks/qwen3_stages.py --real-size --device cuda --streams 1,16 --frames 24 --rounds 2 --json
# One real-size Qwen3 frame taken apart: graph replay vs launched op by op, kernels per frame and
# the GPU's busy time in them (is the frame bound by kernel count or by the GPU's work?).
step frame 60 python3 benchmarks/talker_frame.py --real-size --device cuda --batch 1,16 --frames 30 --json
# Every test file with `cuda` tests (the engine tests that run on both devices; test_gpu_check.py
# checks none is left out), the speech stages' first, the diffusion ones (diffusers, carried) last;
# the talker modules' `cuda` tests are the graphed path against transformers' codes. On CPU all of
# these ran on the emulated device (tests/unit/fake_cuda.py) first.
# -v: each test's name and result is printed as it ends, so a step cut at its limit still names the
# ones that passed and failed (pytest-timeout is not on that machine: the ini's timeout is ignored);
# -rs names the reason of each skip (a module whose import is missing).
step cuda_tests 200 python3 -m pytest -v -rfEs -p no:cacheprovider -m cuda -o addopts="" \
  tests/unit/test_qwen3_static.py tests/unit/test_qwen3_static_full.py tests/unit/test_qwen3_subtalker.py \
  tests/unit/test_qwen3_code2wav.py tests/unit/test_qwen25_token2wav.py tests/unit/test_cuda_ipc.py \
  tests/unit/test_qwen3_talker.py tests/unit/test_qwen25_omni.py tests/unit/test_bench_qwen3_stages.py \
  tests/unit/test_qwen_image.py tests/unit/test_wan.py
step qwen25_stages 90 python3 benchmarks/qwen3_stages.py --model qwen25 --real-size --device cuda --streams 1,16 --frames 24 --rounds 2 --json
step token2wav 60 python3 benchmarks/token2wav_stream.py --real-size --device cuda --codes 250 --runs 2 --json
step transport 60 python3 benchmarks/transport.py --device cuda --json
# The wider stream counts, without the eager path (GPU.md has its figures: ~283 ms a step).
step qwen3_wide 120 python3 benchmarks/qwen3_stages.py --real-size --device cuda --streams 4,64 --frames 24 --rounds 2 --modes static,graphed --json
echo "gpu_check: done, $((DEADLINE - SECONDS))s of the ${BUDGET}s budget left"
