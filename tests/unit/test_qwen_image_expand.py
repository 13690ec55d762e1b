"""Issue 26: the AR -> DiT pipeline's parts: the processor that hands the LM's text to the DiT, the
bundled deploy, and the config checks of `pipeline.images.expand`."""

from __future__ import annotations

import pytest

from omni import config
from omni.engines.base import ImageParams
from omni.errors import ConfigError
from omni.models.qwen_image.processors import lm_to_dit
from omni.orchestrator.request_state import ProcessorContext
from omni.orchestrator.types import PipelineRequest
from omni.stage.messages import Output
from tests.unit.api_fakes import tokenizer  # noqa: F401  (a byte-level BPE fixture)

PARAMS = ImageParams(width=32, height=32, num_inference_steps=2, guidance_scale=1.0, seed=3)


def feed(tok, pieces: list[list[int]], client: str = "a cat") -> list:
    """The pieces through the processor as one LM request's outputs, the last one finishing it."""
    ctx = ProcessorContext(lambda ids: tok.decode(ids, skip_special_tokens=True),
                           PipelineRequest(request_id="r", prompt_token_ids=[1], text=client, image=PARAMS))
    state: dict = {}
    sent = [lm_to_dit(ctx, state, Output(request_id="r", token_ids=p, finished=i == len(pieces) - 1))
            for i, p in enumerate(pieces)]
    assert all(s == [] for s in sent[:-1])     # nothing before the LM finishes
    return sent[-1]


def test_the_dit_gets_the_lms_whole_text_once_with_the_clients_image_parameters(tokenizer):  # noqa: F811
    text = " A red café ☕ at dawn, soft light. "
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    # One id a piece: "☕" is three byte-level tokens, so decoding piece by piece would break it.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    (inp,) = feed(tokenizer, [[i] for i in ids])
    assert (inp.text, inp.image, inp.token_ids, inp.tensors) == (text.strip(), PARAMS, None, {})
    assert not inp.stream and inp.sub_id is None       # the DiT's one input, marked final by the orchestrator


def test_an_lm_that_writes_nothing_leaves_the_clients_prompt(tokenizer):  # noqa: F811
    (inp,) = feed(tokenizer, [tokenizer.encode("  \n"), [tokenizer.eos_token_id]], client="blue sea")
    assert inp.text == "blue sea"


def test_the_bundled_deploy_is_an_lm_writing_for_the_dit(monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    c = config.load("/some/qwen-image-folder", "qwen-image-prompt-expand")
    writer, dit = c.stages
    assert (writer.engine, writer.inputs, writer.model, writer.final_output_type) == \
        ("torch_lm", ("prompt",), "HuggingFaceTB/SmolLM2-135M-Instruct", "text")
    assert (dit.engine, dit.inputs, dit.processor, dit.final_output_type) == \
        ("qwen_image", (0,), "omni.models.qwen_image.processors:lm_to_dit", "image")
    assert c.model == "/some/qwen-image-folder" and "{prompt}" in c.pipeline.images.expand.user
    # A variant: never a model id's default.
    assert all(p.name != "qwen-image-prompt-expand.yaml" for p in config.bundled_configs().values())


def stages(expand: dict | None, dit_inputs=(0,), writer_inputs=("prompt",)) -> dict:
    images = {"expand": expand} if expand is not None else {}
    return {"model": "m", "pipeline": {"images": images}, "stages": [
        {"stage_id": 0, "engine": "torch_lm", "inputs": list(writer_inputs)},
        {"stage_id": 1, "engine": "qwen_image", "inputs": list(dit_inputs), "final_output": True,
         "final_output_type": "image"}]}


@pytest.mark.parametrize("data, says", [
    (stages({"system": "s"}, dit_inputs=("text",)), "fed by an earlier stage"),
    (stages({"system": "s"}, writer_inputs=("text",)), "stage 0 must take the rendered chat"),
    (stages({"system": "s", "user": "no placeholder"}), "must hold {prompt}"),
    (stages({"user": "{prompt}"}), "missing required field `system`"),
    (stages({"system": "s", "template": "x"}), "unknown field `template`"),
])
def test_a_bad_expand_section_is_refused_naming_it(data, says):
    with pytest.raises(ConfigError, match="pipeline.images.expand") as e:
        config.parse(data, "test")
    assert says in str(e.value)
    assert config.parse(stages({"system": "s"}), "test").pipeline.images.expand.user == "{prompt}"
