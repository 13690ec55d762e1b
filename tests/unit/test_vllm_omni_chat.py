"""vllm-omni's chat request on /v1/chat/completions: `sampling_params_list` (one sampling per stage, from
the request) and its default modalities (a chat that names none gets every output, where the deploy says so)."""

from __future__ import annotations

import pytest

from omni import config as cfg
from omni.errors import BadRequest, ConfigError
from omni.orchestrator import events as ev
from omni.orchestrator.types import PipelineRequest
from omni.sampling import SamplingOverrides
from tests.unit.api_fakes import assert_error, chat_body, make, tokenizer  # noqa: F401 (a fixture)
from tests.unit.test_orchestrator_core import ALL, chat, ids, make_core, of, output

pytestmark = pytest.mark.anyio

# vllm-omni's example request for Qwen3-Omni (examples/online_serving/qwen3_omni): thinker, talker, code2wav.
EXAMPLE = [{"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 50, "seed": 42, "repetition_penalty": 1.05,
            "stop_token_ids": [7]},
           {"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False,
            "repetition_penalty": 1.05, "stop_token_ids": [2150]},
           {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
            "repetition_penalty": 1.1}]


async def test_each_entry_is_its_stages_sampling_and_entry_0_the_requests(tokenizer):
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(temperature=1.5, max_tokens=9,
                                                           sampling_params_list=EXAMPLE))
    assert r.status_code == 200, r.text
    req = orch.requests[0]
    s = req.sampling            # entry 0 in place of the request's own temperature and max_tokens
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, s.repetition_penalty, s.stop_token_ids) == \
        (0.4, 0.9, 1, 50, 42, 1.05, (7,))
    talker, code2wav = req.stage_overrides[1], req.stage_overrides[2]
    assert talker == SamplingOverrides(temperature=0.9, top_p=1.0, top_k=50, max_tokens=4096, seed=42,
                                       repetition_penalty=1.05, stop_token_ids=(2150,), presence_penalty=0.0,
                                       frequency_penalty=0.0, min_tokens=0, ignore_eos=False)
    assert code2wav.top_k == 0 and code2wav.max_tokens == 65536      # -1: off, as 0


async def test_what_an_entry_leaves_out_is_vllms_default_and_later_stages_keep_their_own(tokenizer):
    orch, c = make(tokenizer)
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{"seed": 3}]))
    assert r.status_code == 200, r.text
    s = orch.requests[0].sampling
    assert (s.temperature, s.max_tokens, s.seed, s.top_k) == (1.0, 16, 3, 0)     # SamplingParams(**entry)
    assert orch.requests[0].stage_overrides == {}


@pytest.mark.parametrize("entries, param, contains", [
    ([{}, {"min_p": 0.1}], "sampling_params_list[1]", "unknown field `min_p`"),
    ([{"temperature": 3}], "sampling_params_list[0].temperature", "<= 2.0"),
    ([{"max_tokens": 120}, {}, {}], "sampling_params_list[0].max_tokens", "maximum context length is 128"),
    ({"0": {}}, "sampling_params_list", "Expected `array | null`, got `object`"),
    ([{}] * 4, "sampling_params_list", "sampling_params_list has 4 entries; this pipeline has 3 stages"),
    ([{}, {"max_tokens": 4096}], "sampling_params_list[1].max_tokens", "above this server's limit of 120"),
    ([{"max_tokens": 121}], "sampling_params_list[0].max_tokens", "above this server's limit of 120"),
])
async def test_a_bad_entry_is_a_400_naming_it(tokenizer, entries, param, contains):
    orch, c = make(tokenizer, num_stages=3, max_tokens_limit=120)
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=entries))
    assert_error(r, 400, param=param, contains=contains)
    assert orch.requests == []


async def test_the_spec_states_the_entries_and_the_servers_limit_on_each(tokenizer):
    _, c = make(tokenizer, num_stages=3, max_tokens_limit=100)
    schemas = (await c.get("/openapi.json")).json()["components"]["schemas"]
    listed = schemas["ChatCompletionRequest"]["properties"]["sampling_params_list"]["anyOf"][0]
    assert listed["maxItems"] == 3 and listed["items"] == {"$ref": "#/components/schemas/StageSampling"}
    entry = schemas["StageSampling"]
    assert entry["additionalProperties"] is False
    assert entry["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 100
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{}, {}]))
    assert r.status_code == 200, r.text      # an omitted max_tokens is vLLM's 16, within the limit


def test_the_orchestrator_sends_a_listed_stage_its_entry_and_refuses_a_stage_it_lacks():
    core = make_core(*ALL)
    listed = SamplingOverrides(temperature=0.0, max_tokens=5, noise_scale=None)
    req = chat()
    core.submit(PipelineRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "stage_overrides": {1: listed}}))
    (talk,) = of(core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. "))), ev.Send)
    assert talk.message.overrides == listed          # in place of the deploy's noise_scale 0.0
    with pytest.raises(BadRequest, match="sampling_params_list: entry 3 names no later stage"):
        core.submit(PipelineRequest(request_id="r2", prompt_token_ids=[1], stage_overrides={3: listed}))
    with pytest.raises(BadRequest, match="entry 0 names no later stage"):
        core.submit(PipelineRequest(request_id="r3", prompt_token_ids=[1], stage_overrides={0: listed}))


async def test_a_chat_naming_no_modalities_gets_the_deploys_default(tokenizer):
    orch, c = make(tokenizer, audio_out=True, speakers=("ethan",), default_modalities=("text", "audio"))
    orch.audio_chunks = 1
    r = await c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    assert orch.requests[0].modalities == ("text", "audio") and orch.requests[0].audio_out
    assert r.json()["choices"][1]["message"]["audio"]["data"]
    orch.audio_chunks = 0                                           # the pipeline stops at the thinker
    r = await c.post("/v1/chat/completions", json=chat_body(modalities=["text"]))
    assert orch.requests[1].modalities == ("text",) and not orch.requests[1].audio_out
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["message"].get("audio") is None
    orch, c = make(tokenizer, audio_out=True, speakers=("ethan",))   # OpenAI's default otherwise
    await c.post("/v1/chat/completions", json=chat_body())
    assert orch.requests[0].modalities == ("text",)


def test_the_qwen_omni_deploys_default_to_text_and_audio_as_vllm_omni():
    assert cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct").pipeline.default_modalities == ("text", "audio")
    assert cfg.load("Qwen/Qwen2.5-Omni-3B").pipeline.default_modalities == ("text", "audio")   # inherited
    assert cfg.load("Qwen/Qwen3-Omni-30B-A3B-Thinking").pipeline.default_modalities == ("text",)
    assert cfg.load("HuggingFaceTB/SmolLM2-135M-Instruct").pipeline.default_modalities == ("text",)


@pytest.mark.parametrize("base, value", [("qwen3-omni-moe-thinker-only", "[text, audio]"),
                                         ("smollm2-135m-instruct", "[]"), ("smollm2-135m-instruct", "[image]")])
def test_a_default_modality_the_pipeline_lacks_is_refused(tmp_path, base, value):
    path = tmp_path / "d.yaml"
    path.write_text(f"base_config: {base}.yaml\npipeline: {{default_modalities: {value}}}\n")
    with pytest.raises(ConfigError, match=r"pipeline.default_modalities must be text and/or audio"):
        cfg.load("m", str(path))


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


async def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_named(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = THINKING
    orch, c = make(tok)
    r = await c.post("/v1/chat/completions", json=chat_body(chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text
    assert tok.decode(orch.requests[0].prompt_token_ids).endswith("assistant\n<think>\n\n</think>\n\n")
    r = await c.post("/tokenize", json={"messages": chat_body()["messages"],
                                        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.json()["tokens"] == orch.requests[0].prompt_token_ids
    await c.post("/v1/chat/completions", json=chat_body())
    assert "<think>" not in tok.decode(orch.requests[1].prompt_token_ids)
    r = await c.post("/v1/chat/completions", json=chat_body(chat_template_kwargs={"use_tts_template": True}))
    assert_error(r, 400, param="chat_template_kwargs.use_tts_template", contains="the chat template does not read it")
    r = await c.post("/v1/chat/completions", json=chat_body(chat_template_kwargs={"tokenize": True}))
    assert_error(r, 400, param="chat_template_kwargs.tokenize", contains="a parameter of the rendering")
    assert len(orch.requests) == 2
    spec = (await c.get("/openapi.json")).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "TokenizeRequest"):
        assert spec[name]["properties"]["chat_template_kwargs"]["anyOf"][0]["propertyNames"] == {"enum": ["enable_thinking"]}
    _, plain = make(tokenizer)             # a template that reads nothing but the messages: no key passes
    spec = (await plain.get("/openapi.json")).json()["components"]["schemas"]
    assert spec["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]["anyOf"][0]["maxProperties"] == 0


async def test_the_voice_at_the_top_level_as_vllm_omni_takes_it(tokenizer):
    orch, c = make(tokenizer, audio_out=True, speakers=("ethan", "chelsie"), default_modalities=("text", "audio"))
    orch.audio_chunks = 1
    for body, voice in (({"speaker": "Chelsie"}, "chelsie"), ({"voice": " ethan "}, "ethan"),
                        ({"audio": {"voice": "chelsie"}, "speaker": "CHELSIE"}, "chelsie"), ({}, "ethan"),
                        ({"audio": {"voice": {"id": "chelsie"}, "format": "wav"}}, "chelsie")):   # OpenAI's VoiceID
        r = await c.post("/v1/chat/completions", json=chat_body(**body))
        assert r.status_code == 200, r.text
        assert orch.requests[-1].voice == voice
    r = await c.post("/v1/chat/completions", json=chat_body(audio={"voice": "ethan"}, speaker="chelsie"))
    assert_error(r, 400, param="audio.voice", contains="audio.voice and speaker name different voices")
    r = await c.post("/v1/chat/completions", json=chat_body(audio={"voice": {"id": "ethan"}}, speaker="chelsie"))
    assert_error(r, 400, param="audio.voice", contains="audio.voice and speaker name different voices")
    # an unknown voice's 404 names the field the client used, not one it did not send
    for field, body in (("speaker", {"speaker": "uncle_fu"}), ("voice", {"voice": "uncle_fu"}),
                        ("audio.voice", {"audio": {"voice": "uncle_fu"}})):
        r = await c.post("/v1/chat/completions", json=chat_body(**body))
        assert_error(r, 404, param=field, contains="voice `uncle_fu` does not exist; available: ethan, chelsie")
    _, piper = make(tokenizer, speech_entry_stage=1)       # voices from the store (Piper's, presets)
    for field, body in (("speaker", {"speaker": "bob"}), ("audio.voice", {"audio": {"voice": "bob"}})):
        r = await piper.post("/v1/chat/completions", json=chat_body(modalities=["text", "audio"], **body))
        assert_error(r, 404, param=field, contains="voice `bob` does not exist")
    r = await piper.post("/v1/audio/speech", json={"model": "tiny", "input": "hi", "speaker": "bob"})
    assert_error(r, 404, param="speaker", contains="voice `bob` does not exist")


async def test_a_talker_entrys_presence_or_frequency_penalty_is_a_400_naming_it(tokenizer):
    """The Qwen-Omni talkers take no presence/frequency penalty: an entry setting one for stage 1 is refused by
    its path before the thinker runs (it was passed on and ignored); 0 (off) and the thinker's own pass."""
    orch, c = make(tokenizer, num_stages=3)
    c._transport.app.state.frontend.refused_stage_sampling = {1: {"presence_penalty": "codes", "frequency_penalty": "x"}}
    for field in ("presence_penalty", "frequency_penalty"):
        r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{}, {field: 0.5}]))
        assert_error(r, 400, param=f"sampling_params_list[1].{field}", contains="not supported by stage 1")
    assert orch.requests == []
    for entries in ([{}, {"presence_penalty": 0.0}], [{"presence_penalty": 0.5}, {}], [{}, {}, {"presence_penalty": 1}]):
        assert (await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=entries))).status_code == 200


async def test_a_talker_entrys_stop_token_ids_past_its_codec_end_is_a_400_naming_it(tokenizer):
    """The talker stops at its codec's end only: an entry naming another code is refused by its path before the
    thinker runs (it reached the talker, which failed it with stage, replica and class and a WARNING)."""
    orch, c = make(tokenizer, num_stages=3)
    c._transport.app.state.frontend.stage_codec_stops = {1: {2150}}
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{}, {"stop_token_ids": [2150, 5]}]))
    assert_error(r, 400, param="sampling_params_list[1].stop_token_ids", contains="codec's end [2150] and at no other")
    assert orch.requests == []
    for entries in ([{}, {"stop_token_ids": [2150]}], [{"stop_token_ids": [5]}, {}], [{}, {}, {"stop_token_ids": [5]}]):
        assert (await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=entries))).status_code == 200


async def test_a_later_entry_without_a_seed_does_not_take_entry_0s(tokenizer):
    """An unset override keeps the request's value, so a talker entry's seed -1 (or none) ran with entry 0's seed
    and its audio repeated; each entry is whole, and vLLM's default is no seed."""
    orch, c = make(tokenizer)
    for _ in range(2):
        r = await c.post("/v1/chat/completions", json=chat_body(
            sampling_params_list=[{"seed": 1}, {"temperature": 0.9, "seed": -1}, {"temperature": 0.9}]))
        assert r.status_code == 200, r.text
    first, second = (req.stage_overrides for req in orch.requests)
    for i in (1, 2):
        assert first[i].seed is not None and first[i].seed != 1, first[i]
        assert first[i].seed != second[i].seed
    assert orch.requests[0].sampling.seed == 1


def _pipeline_of(tmp_path, deploy: str, fe) -> None:
    """`fe` checks entries as omni/frontend.py sets it up for `deploy` (a folder of no weights)."""
    from omni.frontend import stage_sampling

    (tmp_path / "config.json").write_text("{}")
    stage_sampling(fe, cfg.load(str(tmp_path), deploy))


@pytest.mark.parametrize("entry, field", [({"max_tokens": 1}, "max_tokens"), ({"temperature": 2.0}, "temperature"),
                                          ({"seed": 1}, "seed"), ({"stop_token_ids": [5]}, "stop_token_ids"),
                                          ({"top_k": 5}, "top_k"), ({"min_tokens": 2}, "min_tokens")])
async def test_an_entry_for_piper_s_talker_setting_what_it_does_not_sample_is_a_400_naming_it(
        tokenizer, tmp_path, entry, field):
    """The default pipeline's Piper talker samples no tokens: an entry's max_tokens, temperature, seed, stops
    ... were passed on and ignored (max_tokens 1 gave 2.2 s of audio, one seed two different ones)."""
    orch, c = make(tokenizer, num_stages=3)
    _pipeline_of(tmp_path, "smollm2-135m-instruct", c._transport.app.state.frontend)
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{"max_tokens": 8}, entry]))
    assert_error(r, 400, param=f"sampling_params_list[1].{field}",
                 contains="is not supported by stage 1 (piper_talker): Piper's talker speaks the text")
    assert orch.requests == []


async def test_an_entry_of_defaults_for_piper_s_talker_and_any_for_its_vocoder_pass(tokenizer, tmp_path):
    orch, c = make(tokenizer, num_stages=3, max_tokens_limit=100)
    _pipeline_of(tmp_path, "smollm2-135m-instruct", c._transport.app.state.frontend)
    for talker in ({}, {"temperature": 1.0, "top_k": -1, "seed": -1, "top_p": 1.0, "detokenize": False,
                        "stop_token_ids": [], "repetition_penalty": 1.0, "presence_penalty": 0}):
        r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{}, talker, EXAMPLE[2]]))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("deploy", ["qwen3-omni-moe", "qwen2.5-omni-7b"])
async def test_vllm_omnis_example_entries_pass_on_the_qwen_pipelines(tokenizer, tmp_path, monkeypatch, deploy):
    """vllm-omni's example clients send code2wav an entry (temperature 0, repetition_penalty 1.1, max_tokens
    65536) that its vocoder does not sample with: taken whole, even past the server's max_tokens limit."""
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    orch, c = make(tokenizer, num_stages=3, max_tokens_limit=5000)
    _pipeline_of(tmp_path, deploy, c._transport.app.state.frontend)
    talker = {k: v for k, v in EXAMPLE[1].items() if k != "stop_token_ids"}   # the Qwen3 codec end, in the example
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[EXAMPLE[0], talker, EXAMPLE[2]]))
    assert r.status_code == 200, r.text
    assert orch.requests[0].stage_overrides[2].seed == 42        # Qwen2.5's token2wav draws its noise from it
    r = await c.post("/v1/chat/completions", json=chat_body(sampling_params_list=[{}, {"max_tokens": 9000}]))
    assert_error(r, 400, param="sampling_params_list[1].max_tokens", contains="above this server's limit of 5000")
