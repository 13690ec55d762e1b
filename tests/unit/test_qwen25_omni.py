"""Qwen2.5-Omni talker and token2wav engines against transformers' generate() on the tiny model
(float32, greedy thinker and talker, torch.manual_seed(seed)): codes exact, waveform to int16. The
talker tests run on both decode paths (the static step, the default, and the eager one)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingParams
from tests.unit.qwen25_ref import Reference, talker_pieces
from tests.unit.qwen3_ref import drive, path_args

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

TALKER_TOKENS = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.qwen25_omni import tiny as qwen25_omni_tiny

    torch.set_num_threads(1)
    return qwen25_omni_tiny.build(tmp_path_factory.mktemp("qwen25_tiny"))


@pytest.fixture(scope="module")
def ref(folder):
    return Reference(folder)


@pytest.fixture(scope="module")
def talker(folder, talker_path):
    from omni.models.qwen25_omni.talker import Qwen25TalkerEngine

    return Qwen25TalkerEngine(folder, **path_args(talker_path))


@pytest.fixture(scope="module")
def t2w(folder):
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    return Qwen25Token2WavEngine(folder, stream=False)     # the exact whole decode; streamed: test_qwen25_token2wav.py


@pytest.fixture(scope="module")
def t2w_streamed(folder):
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    return Qwen25Token2WavEngine(folder, first_block_codes=6, block_codes=12)


@pytest.fixture(scope="module")
def france(ref):
    return ref.run("What is the capital of France?", "Chelsie", talker_tokens=TALKER_TOKENS, seed=0)


@pytest.fixture(scope="module")
def sea(ref):
    return ref.run("Hello, tell me a story about the sea.", "Ethan", thinker_tokens=6,
                   talker_tokens=TALKER_TOKENS - 9, seed=1)


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)[0]


def _int16(wav: torch.Tensor) -> torch.Tensor:
    return torch.round(wav.clamp(-1, 1) * 32767).to(torch.int16)


def _t2w_piece(rid, codes, speaker, seed, final=True):
    return EngineRequest(request_id=rid, tensors={"codes": codes[None]}, sampling=SamplingParams(seed=seed),
                         voice=speaker, final=final)


def test_tiny_folder_is_byte_identical_per_seed(folder, tmp_path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni.models.qwen25_omni import tiny as qwen25_omni_tiny

    again = qwen25_omni_tiny.build(tmp_path / "again")
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(again.iterdir())}
    assert {"spk_dict.pt", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= set(digest)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    assert 1_500_000 < n < 4_000_000 and all(torch.isfinite(p).all() for p in model.parameters())
    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    assert model.config.thinker_config.text_config.hidden_size // 2 == 32     # head_dim 32 for vLLM CPU


@pytest.mark.parametrize("per_token", [False, True], ids=["whole", "per-token"])
def test_codes_equal_reference(talker, france, per_token):
    outs = drive(talker, {"r": talker_pieces(france, "r", "chelsie", per_token, TALKER_TOKENS)})["r"]
    assert torch.equal(_codes(outs), france.codes)
    assert [o.tensors["codes"].shape[1] for o in outs] == [25, 15]
    assert outs[-1].finish_reason == "length" and outs[0].num_prompt_tokens == len(france.prompt)
    assert not talker.has_open_streams()


def test_pre_norm_rows_give_the_same_codes(talker, france):
    """The thinker may send its last layer before the final norm; the talker applies the norm."""
    rows = talker.norm(france.last_layer.to(talker.device))
    assert torch.equal(rows.cpu(), france.hidden)
    outs = drive(talker, {"p": talker_pieces(france, "p", "chelsie", True, TALKER_TOKENS, pre_norm=True)})["p"]
    assert torch.equal(_codes(outs), france.codes)


def test_talker_to_token2wav_waveform(talker, t2w, france):
    """The talker's chunks stream into token2wav, which decodes the utterance whole once it is final."""
    before = torch.random.get_rng_state()
    audio = []

    def on_codes(o):
        t2w.add_request(_t2w_piece("w", o.tensors["codes"][0], "Chelsie", 0, o.finished))
        while t2w.has_unfinished():
            audio.extend(a.tensors["audio"] for a in t2w.step())
    drive(talker, {"w": talker_pieces(france, "w", "Chelsie", True, TALKER_TOKENS)}, on_output=on_codes)
    wav = torch.cat(audio)
    assert wav.shape == france.wav.shape == (TALKER_TOKENS * 2 * 240,)
    assert torch.equal(_int16(wav), _int16(france.wav))
    assert (wav - france.wav).abs().max() < 1e-6
    assert torch.equal(torch.random.get_rng_state(), before)      # the process RNG is never drawn
    assert t2w.sample_rate == 24000 and not t2w.has_open_streams()


def test_talker_to_streamed_token2wav(talker, t2w_streamed, france):
    """Streamed token2wav: audio before the talker's last chunk, the whole decode's to int16 rounding."""
    audio, talker_done = [], []

    def on_codes(o):
        t2w_streamed.add_request(_t2w_piece("v", o.tensors["codes"][0], "Chelsie", 0, o.finished))
        while t2w_streamed.has_unfinished():
            audio.extend((a.tensors["audio"], bool(talker_done)) for a in t2w_streamed.step())
        talker_done.append(o.finished)
    drive(talker, {"v": talker_pieces(france, "v", "Chelsie", True, TALKER_TOKENS)}, on_output=on_codes)
    wav = torch.cat([a for a, _ in audio])
    assert wav.shape == france.wav.shape and (wav - france.wav).abs().max() < 1e-6
    assert (_int16(wav).int() - _int16(france.wav).int()).abs().max() <= 1
    assert audio[0][0].numel() == 6 * 2 * 240 and not audio[0][1]      # before the talker's second chunk


def test_two_concurrent_requests(talker, t2w, france, sea):
    before = talker.stats().get("batched_decodes", 0)
    outs = drive(talker, {"a": talker_pieces(france, "a", "Chelsie", True, TALKER_TOKENS),
                          "b": talker_pieces(sea, "b", "ETHAN", False, TALKER_TOKENS - 9)})
    assert torch.equal(_codes(outs["a"]), france.codes)
    assert torch.equal(_codes(outs["b"]), sea.codes)
    assert talker.stats()["batched_decodes"] > before     # one forward served both
    wavs = drive(t2w, {"a": [_t2w_piece("a", france.codes, "chelsie", 0)],
                       "b": [_t2w_piece("b", sea.codes, "ethan", 1)]})
    assert torch.equal(_int16(wavs["a"][-1].tensors["audio"]), _int16(france.wav))
    assert torch.equal(_int16(wavs["b"][-1].tensors["audio"]), _int16(sea.wav))
    assert {w[-1].sample_rate for w in wavs.values()} == {24000}      # the API writes it into the WAV


def test_a_concurrent_request_does_not_change_anothers_audio(t2w, france, sea):
    """Per-request generators: the same seed gives the same audio whatever runs before or beside it;
    a different seed gives different audio."""
    alone = drive(t2w, {"x": [_t2w_piece("x", france.codes, "chelsie", 7)]})["x"][-1].tensors["audio"]
    crowd = drive(t2w, {"y": [_t2w_piece("y", sea.codes, "ethan", 3)],
                        "y2": [None, _t2w_piece("y2", sea.codes, "ethan", 9)],
                        "x": [None, _t2w_piece("x", france.codes[:10], "chelsie", 7, final=False),
                              EngineRequest(request_id="x", tensors={"codes": france.codes[None, 10:]})]})
    assert torch.equal(crowd["x"][-1].tensors["audio"], alone)
    other = drive(t2w, {"z": [_t2w_piece("z", france.codes, "chelsie", 8)]})["z"][-1].tensors["audio"]
    assert not torch.equal(other, alone)


def test_audio_input(ref, talker):
    audio = ref.run("Describe this sound.", "Ethan", audio=True, talker_tokens=TALKER_TOKENS)
    outs = drive(talker, {"x": talker_pieces(audio, "x", "ethan", True, TALKER_TOKENS)})["x"]
    assert torch.equal(_codes(outs), audio.codes)


def test_thinker_eos_ends_the_text(folder, ref, france, talker_path):
    """The thinker stopping on its EOS: that EOS is replaced by tts_eos, then tts_pad."""
    from omni.models.qwen25_omni.talker import Qwen25TalkerEngine

    eos = france.generated[4]
    stopped = ref.run("What is the capital of France?", "Chelsie", talker_tokens=TALKER_TOKENS, eos=eos)
    assert stopped.generated[-1] == eos and len(stopped.generated) <= 5
    engine = Qwen25TalkerEngine(folder, text_eos_token_ids=[eos], **path_args(talker_path))
    pieces = talker_pieces(stopped, "e", "chelsie", True, TALKER_TOKENS)
    pieces[-1].final = False      # the EOS alone closes the text
    outs = drive(engine, {"e": pieces})["e"]
    assert torch.equal(_codes(outs), stopped.codes)


def test_bad_requests(talker, t2w, france):
    with pytest.raises(EngineError, match="unknown speaker 'aiden'; known speakers: chelsie, ethan"):
        talker.add_request(EngineRequest(request_id="q", prompt_token_ids=france.prompt, voice="aiden"))
    with pytest.raises(EngineError, match="not both"):
        talker.add_request(EngineRequest(request_id="q", prompt_token_ids=france.prompt, tensors={
            "thinker_hidden": france.hidden[:2], "thinker_last_layer": france.last_layer[:2]}))
    with pytest.raises(EngineError, match=r"thinker_hidden must be float \[n, 64\]"):
        talker.add_request(EngineRequest(request_id="q", prompt_token_ids=france.prompt,
                                         tensors={"thinker_hidden": torch.zeros(3, 8)}))
    # The stream ends before the rows the prefill needs arrived: an error for that request only.
    outs = drive(talker, {"q": [EngineRequest(request_id="q", prompt_token_ids=france.prompt,
                                              tensors={"thinker_hidden": france.hidden[:3]},
                                              generated_ids=france.generated)]})["q"]
    assert outs[-1].finish_reason == "error" and "thinker_hidden row" in outs[-1].error
    with pytest.raises(EngineError, match=r"codes must lie in \[0, 8194\)"):
        t2w.add_request(EngineRequest(request_id="c", tensors={"codes": torch.tensor([[8292]])}))
    with pytest.raises(EngineError, match="unknown speaker"):
        t2w.add_request(EngineRequest(request_id="c", tensors={"codes": torch.tensor([[1]])},
                                      voice="nobody"))
    assert not talker.has_open_streams() and not t2w.has_open_streams()


def test_stage_weights_only_their_prefix(folder, ref):
    from omni.models.qwen25_omni import weights

    _, talker, embed, norm = weights.load_talker(folder)
    _, t2w = weights.load_token2wav(folder)
    for mine, theirs in ((talker, ref.model.talker), (t2w, ref.model.token2wav)):
        want, got = theirs.state_dict(), mine.state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(embed, ref.model.thinker.model.embed_tokens.weight)
    assert torch.equal(norm.weight, ref.model.thinker.model.norm.weight)
    assert next(t2w.parameters()).dtype == torch.float32


def test_processors():
    from omni.models.qwen25_omni import processors as p
    from omni.orchestrator.types import PipelineRequest
    from omni.stage.messages import Output
    from omni.transport.base import TensorRef

    class Ctx:
        request = PipelineRequest(request_id="r", prompt_token_ids=[1, 2, 3], voice="Ethan")

    rows = TensorRef(transport="shm", endpoint="seg", key=2, dtype="float32", shape=(3, 64), nbytes=768)
    state: dict = {}
    first = p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[7], tensors={"thinker_hidden": rows}))
    assert first[0].token_ids == [1, 2, 3] and (first[0].voice, first[0].generated_ids) == ("Ethan", [7])
    assert first[0].tensors == {"thinker_hidden": rows} and first[0].stream
    later = p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[8], tensors={"thinker_hidden": rows}))
    assert (later[0].voice, later[0].generated_ids) == (None, [8]) and later[0].tensors == {"thinker_hidden": rows}
    assert p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[], finished=True)) == []
    # The vLLM thinker's rows (hidden_rows_layer: last) go on as the pre-norm rows the talker normalises.
    vllm_state: dict = {}
    got = p.thinker_to_talker(Ctx(), vllm_state, Output(request_id="r", token_ids=[7], tensors={"hidden_rows": rows}))
    assert got[0].tensors == {"thinker_last_layer": rows}
    got = p.thinker_to_talker(Ctx(), vllm_state, Output(request_id="r", token_ids=[], tensors={"hidden_rows": rows}))
    assert got[0].tensors == {"thinker_last_layer": rows} and got[0].generated_ids == []
    codes = TensorRef(transport="shm", endpoint="seg", key=1, dtype="int64", shape=(1, 25), nbytes=200)
    s2: dict = {}
    a = p.talker_to_token2wav(Ctx(), s2, Output(request_id="r", tensors={"codes": codes}))
    b = p.talker_to_token2wav(Ctx(), s2, Output(request_id="r", tensors={"codes": codes}))
    assert a[0].voice == "Ethan" and b[0].voice is None and a[0].stream and b[0].stream
    assert p.talker_to_token2wav(Ctx(), s2, Output(request_id="r", finished=True)) == []


def test_factory_builds_both_engines(folder):
    from omni.config import DeployConfig, StageConfig
    from omni.engines.factory import build_engine
    from omni.errors import ConfigError

    stages = (StageConfig(stage_id=1, engine="qwen25_talker", engine_args={"chunk_frames": 10, "threads": 1}),
              StageConfig(stage_id=2, engine="qwen25_token2wav", engine_args={"num_steps": 4}),
              StageConfig(stage_id=3, engine="qwen25_token2wav", engine_args={"steps": 4}))
    config = DeployConfig(model=str(folder), stages=stages)
    assert build_engine(config, stages[0]).chunk_frames == 10
    assert build_engine(config, stages[1]).num_steps == 4
    with pytest.raises(ConfigError, match="steps"):
        build_engine(config, stages[2])


def test_step_times(talker, t2w, france):
    """Talker ms per frame and token2wav real-time factor on the tiny model (printed, -s to see)."""
    t0, s0 = talker.stats().get("talker_seconds", 0.0), talker.stats().get("frames", 0)
    drive(talker, {"t": talker_pieces(france, "t", "chelsie", False, TALKER_TOKENS)})
    st = talker.stats()
    ms = 1000 * (st["talker_seconds"] - t0) / (st["frames"] - s0)
    w0, n0 = t2w.stats().get("token2wav_seconds", 0.0), t2w.stats().get("samples", 0)
    drive(t2w, {"t": [_t2w_piece("t", france.codes, "chelsie", 0)]})
    sw = t2w.stats()
    rtf = (sw["token2wav_seconds"] - w0) / ((sw["samples"] - n0) / 24000)
    print(f"\ntiny Qwen2.5-Omni: talker {ms:.2f} ms/frame (20 ms of audio each), token2wav RTF {rtf:.3f}")
    assert ms > 0 and rtf > 0
