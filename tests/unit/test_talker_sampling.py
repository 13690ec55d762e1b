"""The Qwen-Omni talkers' own sampling (omni/models/qwen3_omni/talker_sampling.py) on the tiny models, both
decode paths: min_tokens and ignore_eos hold the codec end back, top_k -1 is off, presence and frequency
penalties are refused by name."""

from __future__ import annotations

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingOverrides, SamplingParams
from tests.unit.qwen3_ref import drive

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

MAX = 12
TOKS: dict = {}      # engine name -> the tiny model's tokenizer (set by `folders`)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from omni.models.qwen3_omni import tiny as qwen3_tiny
    from omni.models.qwen25_omni import tiny as qwen25_tiny

    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    out = {"qwen3": qwen3_tiny.build(tmp_path_factory.mktemp("q3")),
           "qwen25": qwen25_tiny.build(tmp_path_factory.mktemp("q25"))}
    TOKS.update({"qwen3_talker": AutoTokenizer.from_pretrained(out["qwen3"]),
                 "qwen25_talker": AutoTokenizer.from_pretrained(out["qwen25"])})
    return out


def _engine(folders, model: str, static: bool):
    if model == "qwen3":
        from omni.models.qwen3_omni.talker import Qwen3TalkerEngine as cls
    else:
        from omni.models.qwen25_omni.talker import Qwen25TalkerEngine as cls
    return cls(folders[model], static_decode=static, max_num_seqs=2)


def _request(engine, rid: str, overrides: SamplingOverrides, sampling: SamplingParams | None = None) -> EngineRequest:
    """The thinker's prompt for one question and 4 ids, then its end (Qwen2.5: random thinker rows)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = TOKS[engine.name].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]
    gen = [100, 200, 300, 400, sorted(engine.text_eos)[0]]
    tensors = {}
    if engine.name == "qwen25_talker":
        g = torch.Generator().manual_seed(0)
        tensors = {"thinker_hidden": torch.randn(len(prompt) + len(gen) - 1, engine.embed.shape[1], generator=g)}
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, generated_ids=gen, final=True, tensors=tensors,
                         overrides=overrides, sampling=sampling or SamplingParams(max_tokens=MAX))


def _codes(outs):
    return torch.cat([o.tensors["codes"] for o in outs], dim=1) if "codes" in outs[-1].tensors else None


@pytest.fixture(scope="module", params=[("qwen3", True), ("qwen3", False), ("qwen25", True), ("qwen25", False)],
                ids=["qwen3-static", "qwen3-eager", "qwen25-static", "qwen25-eager"])
def eos_engine(folders, request):
    """A talker whose codec end wins every frame: its codec_head row points along the eager path's hidden
    rows (captured from a plain run), so a request ends at once unless its sampling holds the end back."""
    model, static = request.param
    probe = _engine(folders, model, False)
    rows = []
    hook = probe.talker.codec_head.register_forward_hook(lambda m, i, o: rows.append(i[0].reshape(-1, i[0].shape[-1])))
    drive(probe, {"p": [_request(probe, "p", SamplingOverrides())]})
    hook.remove()
    d = torch.cat(rows).mean(0)
    engine = _engine(folders, model, static)
    with torch.no_grad():
        engine.talker.codec_head.weight[engine.ids.codec_eos] = 3 * d / d.norm()
    return engine


@pytest.mark.parametrize("how", ["plain", "min_tokens", "ignore_eos"])
def test_min_tokens_and_ignore_eos_hold_the_codec_end(eos_engine, how):
    """Unset, the codec end comes at once (Qwen3: no audio); min_tokens 5: five frames, then the end; ignore_eos: no
    end, max_tokens ends it. They were accepted and ignored (codes as unset)."""
    overrides = {"plain": SamplingOverrides(), "min_tokens": SamplingOverrides(min_tokens=5),
                 "ignore_eos": SamplingOverrides(ignore_eos=True)}[how]
    outs = drive(eos_engine, {how: [_request(eos_engine, how, overrides)]})[how]
    codes = _codes(outs)
    frames = 0 if codes is None else codes.shape[1]
    qwen25 = eos_engine.name == "qwen25_talker"
    want = {"plain": (0, "stop"), "min_tokens": (5, "stop"), "ignore_eos": (MAX if qwen25 else MAX - 1, "length")}[how]
    if how == "plain" and qwen25:
        want = (min(frames, 2), "stop")     # its first code or two come before the end wins
    assert (frames, outs[-1].finish_reason) == want
    if codes is not None:
        assert not set(codes[0].tolist()) & eos_engine.codec_stops
    assert not eos_engine.has_open_streams()


def test_min_tokens_codes_equal_on_both_paths(eos_engine, folders):
    """The static step holds the end back on the device as the eager path does on the host: the same codes."""
    other = _engine(folders, "qwen3" if eos_engine.name == "qwen3_talker" else "qwen25", eos_engine._static is None)
    with torch.no_grad():
        other.talker.codec_head.weight.copy_(eos_engine.talker.codec_head.weight)
    got = []
    for engine in (eos_engine, other):
        r = _request(engine, "m", SamplingOverrides(min_tokens=7, temperature=0.9, seed=3))
        got.append(_codes(drive(engine, {"m": [r]})["m"]))
    assert got[0].shape[1] >= 7 and torch.equal(got[0], got[1])


@pytest.mark.parametrize("model", ["qwen3", "qwen25"])
def test_top_k_minus_one_is_off(folders, model):
    """vLLM's top_k -1 (what the deploy check takes) is 0, off: it failed every request (top_k >= 0)."""
    engine = _engine(folders, model, True)
    got = {}
    for k in (-1, 0):
        r = _request(engine, f"k{k}", SamplingOverrides(top_k=k, temperature=0.9, seed=5))
        got[k] = _codes(drive(engine, {f"k{k}": [r]})[f"k{k}"])
    assert torch.equal(got[-1], got[0])


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_are_refused_by_name(folders, field):
    """Set to anything but 0 (off) they are an error naming them, not ignored; 0 (what a sampling_params_list
    entry leaves them) passes."""
    engine = _engine(folders, "qwen3", False)
    with pytest.raises(EngineError, match=f"talker's {field} is not supported"):
        engine.add_request(_request(engine, "p", SamplingOverrides(**{field: 0.5})))
    engine.add_request(_request(engine, "z", SamplingOverrides(**{field: 0.0})))
    # the request's own (the client's, meant for the thinker) stays the thinker's
    engine.add_request(_request(engine, "c", SamplingOverrides(), SamplingParams(max_tokens=MAX, **{field: 0.5})))
