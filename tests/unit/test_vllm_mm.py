"""The vLLM engine's multi-modal request checks and capture config (pure, no EngineCore), and the
torchvision hook that lets vLLM import Qwen3-Omni on a CPU-only torch."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni.engines.vllm import mm as vllm_mm
from omni.engines.base import EngineError, EngineRequest
from omni.errors import ConfigError

AUDIO, IMAGE, VIDEO = 5, 6, 7
TOKENS = vllm_mm.MmTokens(audio=AUDIO, image=IMAGE, video=VIDEO)
LIMITS = {"audio": 2, "image": 0, "video": 0}


def req(prompt, **tensors):
    return EngineRequest(request_id="r", prompt_token_ids=prompt, tensors=tensors)


def test_audio_prompt_becomes_token_ids_plus_waveforms_in_order():
    a0, a1 = torch.ones(1600), np.zeros(3200, dtype=np.float64)
    prompt = [1, 3, AUDIO, 4, 3, AUDIO, 4, 9]
    out, n = vllm_mm.build_prompt(req(prompt, audio_1=a1, audio_0=a0), prompt, TOKENS, LIMITS)
    assert n == 2 and out["prompt_token_ids"] == prompt
    (w0, sr0), (w1, sr1) = out["multi_modal_data"]["audio"]
    assert (sr0, sr1) == (16000, 16000) and w0.dtype == w1.dtype == np.float32
    assert w0.shape == (1600,) and w1.shape == (3200,) and w0[0] == 1.0


def test_text_prompt_has_no_multimodal_data():
    out, n = vllm_mm.build_prompt(req([1, 2, 3]), [1, 2, 3], TOKENS, LIMITS)
    assert n == 0 and out == {"prompt_token_ids": [1, 2, 3]}


@pytest.mark.parametrize("prompt, tensors, needle", [
    ([1, AUDIO], {}, "the prompt holds 1 audio placeholder(s) (token 5) for 0 audio part(s)"),
    ([1, 2], {"audio_0": torch.ones(10)}, "holds 0 audio placeholder(s) (token 5) for 1 audio part(s)"),
    ([1, AUDIO], {"image_0": torch.ones(3, 4, 4)}, "'image_0' refused: images and video are not supported"),
    ([1, AUDIO], {"wave": torch.ones(4)}, "'wave' refused: it takes audio_0, audio_1"),
    ([1, AUDIO], {"audio_1": torch.ones(4)}, "numbered audio_0..audio_0"),
    ([1, AUDIO], {"audio_0": torch.ones(2, 4)}, "audio_0 must be a 1-D mono waveform, got shape [2, 4]"),
    ([1, AUDIO], {"audio_0": torch.tensor([0.0, float("nan")])}, "non-finite samples"),
    ([1, IMAGE, AUDIO], {"audio_0": torch.ones(4)}, "holds 1 image placeholder(s) (token 6) for 0 image part(s)"),
    ([AUDIO] * 3, {f"audio_{i}": torch.ones(4) for i in range(3)},
     "At most 2 audio(s) may be provided in one prompt to this stage; this one has 3"),
])
def test_bad_multimodal_requests_name_the_problem(prompt, tensors, needle):
    with pytest.raises(EngineError) as e:
        vllm_mm.build_prompt(req(prompt, **tensors), prompt, TOKENS, LIMITS)
    assert needle in str(e.value)


def test_default_limits_cover_the_models_modalities_under_the_configs_own():
    args: dict = {}
    vllm_mm.default_limits(args, {"audio", "image"})
    assert args["limit_mm_per_prompt"] == {"audio": 1, "image": 0}
    # a modality the config leaves out keeps omni's default (vLLM's would be 999: images and video on)
    args = {"limit_mm_per_prompt": {"audio": {"count": 3}}}
    vllm_mm.default_limits(args, {"audio", "image", "video"})
    assert args["limit_mm_per_prompt"] == {"audio": {"count": 3}, "image": 0, "video": 0}
    args = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    vllm_mm.default_limits(args, {"audio", "image", "video"})
    assert args["limit_mm_per_prompt"] == {"audio": 1, "image": 0, "video": 0}


@pytest.mark.parametrize("configured, audio", [
    ({"audio": {"count": 2}, "image": 0, "video": 0}, 2),   # vLLM's options form: was "'>' not supported"
    ({"image": 0, "video": 0}, 1),                          # audio left out: omni's default, not 0
    ({"audio": {"length": 16000}}, 999),                    # options without a count: vLLM's 999
])
def test_the_stage_reads_limits_as_vllm_does(configured, audio):
    from vllm.config.multimodal import MultiModalConfig

    args = {"limit_mm_per_prompt": configured}
    vllm_mm.default_limits(args, {"audio", "image", "video"})
    mm = MultiModalConfig(limit_per_prompt=args["limit_mm_per_prompt"])
    limits = vllm_mm.stage_limits(SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm)),
                                  {"audio", "image", "video"})
    assert limits == {"audio": audio, "image": 0, "video": 0}
    prompt, two = [1, AUDIO, AUDIO], {"audio_0": torch.ones(4), "audio_1": torch.ones(4)}
    if audio >= 2:
        assert vllm_mm.build_prompt(req(prompt, **two), prompt, TOKENS, limits)[1] == 2
    else:
        with pytest.raises(EngineError, match=rf"At most {audio} audio\(s\) may be .* to this stage; this one has 2"):
            vllm_mm.build_prompt(req(prompt, **two), prompt, TOKENS, limits)


def _hf(accept=1, layers=2):
    text = SimpleNamespace(num_hidden_layers=layers)
    return SimpleNamespace(thinker_config=SimpleNamespace(text_config=text, audio_token_id=AUDIO),
                           talker_config=SimpleNamespace(accept_hidden_layer=accept))


@pytest.mark.parametrize("layer, hf, args, needle", [
    (5, _hf(), {}, "a layer index in [0, 2), got 5"),
    ("last", _hf(), {}, "got 'last'"),
    (True, _hf(), {}, "got True"),
    ("talker", SimpleNamespace(num_hidden_layers=2), {}, "no talker_config.accept_hidden_layer"),
    (1, _hf(), {"speculative_config": {"method": "ngram"}}, "uses vLLM's speculative_config"),
])
def test_hidden_capture_config_errors_name_the_flag(layer, hf, args, needle):
    with pytest.raises(ConfigError) as e:
        vllm_mm.enable_hidden_capture("stage 0", layer, hf, args)
    assert "engine_args.mm_hidden_layer" in str(e.value) and needle in str(e.value)


def test_no_capture_unless_asked():
    args: dict = {}
    assert vllm_mm.enable_hidden_capture("stage 0", None, _hf(), args) is None and args == {}


@pytest.mark.skipif(importlib.machinery.PathFinder.find_spec("torchvision") is None,
                    reason="torchvision is not installed (make installs it with the vllm extra)")
def test_torchvision_imports_in_a_fresh_interpreter_and_qwen3_omni_processor_classes_load():
    # A fresh interpreter, as vLLM's spawned EngineCore is: the .pth hook that make installs
    # must be what makes the import work (no explicit install() here).
    code = ("import torchvision.transforms.v2.functional as F\n"
            "from transformers.utils.import_utils import is_torchvision_available\n"
            "assert is_torchvision_available()\n"
            "from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor\n"
            "import vllm.model_executor.models.qwen3_omni_moe_thinker\n"
            "print('OK')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "OK" in p.stdout, (p.stdout + p.stderr)[-3000:]
