"""The Qwen3-Omni talker and code2wav engines against transformers' generate(return_audio=True)
on the tiny model (float32, greedy): same codes exactly, same waveform. Every talker test runs on
both decode paths: the static step (the default) and the eager one over transformers' modules."""

from __future__ import annotations

import time

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingOverrides
from tests.unit.qwen3_ref import Reference, drive, path_args, talker_pieces

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

TALKER_TOKENS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.qwen3_omni import tiny as qwen3_omni_tiny

    torch.set_num_threads(1)
    return qwen3_omni_tiny.build(tmp_path_factory.mktemp("qwen3_tiny"))


@pytest.fixture(scope="module")
def ref(folder):
    return Reference(folder)


@pytest.fixture(scope="module")
def talker(folder, talker_path):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    return Qwen3TalkerEngine(folder, **path_args(talker_path))


@pytest.fixture(scope="module")
def code2wav(folder):
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    return Qwen3Code2WavEngine(folder)


@pytest.fixture(scope="module")
def france(ref):
    return ref.run("What is the capital of France?", "Ethan", talker_tokens=TALKER_TOKENS)


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)


def _int16(wav: torch.Tensor) -> torch.Tensor:
    return torch.round(wav.clamp(-1, 1) * 32767).to(torch.int16)


@pytest.mark.parametrize("per_token", [False, True], ids=["whole", "per-token"])
def test_codes_equal_reference(talker, france, per_token):
    outs = drive(talker, {"r": talker_pieces(france, "r", "ethan", per_token, TALKER_TOKENS)})["r"]
    assert torch.equal(_codes(outs), france.codes)
    sizes = [o.tensors["codes"].shape[1] for o in outs]
    assert sizes[0] == 4 and all(n <= 25 for n in sizes[1:])
    assert outs[-1].finish_reason == "length" and outs[0].num_prompt_tokens == len(france.prompt)
    assert not talker.has_open_streams()


def test_talker_to_code2wav_waveform(talker, code2wav, france):
    pieces = talker_pieces(france, "w", "Ethan", True, TALKER_TOKENS)
    streamed = []

    def to_code2wav(o):   # the talker's chunks go on as they come
        code2wav.add_request(EngineRequest(request_id="w", tensors={"codes": o.tensors["codes"]},
                                           final=o.finished))
        while code2wav.has_unfinished():
            streamed.extend(a.tensors["audio"] for a in code2wav.step())
    outs = drive(talker, {"w": pieces}, on_output=to_code2wav)["w"]
    audio = torch.cat(streamed)
    assert audio.shape == france.wav.shape
    assert (audio - france.wav).abs().max() < 1e-3
    # Non-streamed: the whole code sequence in one piece is the reference to int16 rounding.
    code2wav.add_request(EngineRequest(request_id="n", tensors={"codes": _codes(outs)}))
    whole = torch.cat([a.tensors["audio"] for a in drive(code2wav, {"n": []})["n"]])
    assert torch.equal(_int16(whole), _int16(france.wav))
    assert code2wav.sample_rate == 24000


def test_two_concurrent_requests(ref, talker, france):
    other = ref.run("Hello, tell me a story about the sea.", "Chelsie", thinker_tokens=6,
                    talker_tokens=TALKER_TOKENS)
    before = talker.stats().get("batched_decodes", 0)
    outs = drive(talker, {"a": talker_pieces(france, "a", "ethan", True, TALKER_TOKENS),
                          "b": talker_pieces(other, "b", "CHELSIE", False, TALKER_TOKENS)})
    assert torch.equal(_codes(outs["a"]), france.codes)
    assert torch.equal(_codes(outs["b"]), other.codes)
    assert talker.stats()["batched_decodes"] > before     # one forward served both


def test_batch_changes_keep_every_request_exact(ref, talker, france):
    """Requests joining late, skipping steps (text not there yet) and finishing early."""
    other = ref.run("Hello, tell me a story about the sea.", "Chelsie", thinker_tokens=6,
                    talker_tokens=TALKER_TOKENS)
    gappy = talker_pieces(france, "d", "ethan", True, TALKER_TOKENS)
    gappy = [x for p in gappy for x in (p, None, None)]
    feeds = {"a": talker_pieces(france, "a", "ethan", True, TALKER_TOKENS),
             "b": talker_pieces(other, "b", "chelsie", False, TALKER_TOKENS),
             "c": [None] * 3 + talker_pieces(france, "c", "ethan", False, 10),
             "d": gappy}
    before = talker.stats().get("batch_builds", 0)
    moves = talker.stats().get("slot_moves", 0)
    outs = drive(talker, feeds)
    assert torch.equal(_codes(outs["a"]), france.codes)
    assert torch.equal(_codes(outs["b"]), other.codes)
    assert torch.equal(_codes(outs["c"]), france.codes[:, :9]) and outs["c"][-1].finish_reason == "length"
    assert torch.equal(_codes(outs["d"]), france.codes)
    if talker._static is None:
        assert talker.stats()["batch_builds"] - before > 3
    else:   # c ends first and b before d: their slots were taken by the last slot's request
        assert talker.stats()["slot_moves"] - moves >= 1
    assert not talker.has_open_streams()


def test_audio_input(ref, talker):
    audio = ref.run("Describe this sound.", "Aiden", audio=True, talker_tokens=TALKER_TOKENS)
    assert audio.mm_hidden is not None and audio.mm_hidden.shape[0] > 0
    outs = drive(talker, {"x": talker_pieces(audio, "x", "aiden", True, TALKER_TOKENS)})["x"]
    assert torch.equal(_codes(outs), audio.codes)
    # The placeholders need their hidden rows.
    with pytest.raises(EngineError, match="mm_hidden has 0 row"):
        talker.add_request(EngineRequest(request_id="y", prompt_token_ids=audio.prompt,
                                         voice="aiden"))


def test_thinker_eos_ends_the_text(folder, ref, talker_path):
    """The thinker stopping on its EOS: the talker feeds that EOS, then tts_eos, then tts_pad."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    probe = ref.run("What is the capital of France?", thinker_tokens=8, talker_tokens=2)
    eos = probe.generated[3]      # pretend this id is the thinker's EOS: it stops there
    stopped = ref.run("What is the capital of France?", thinker_tokens=8, talker_tokens=TALKER_TOKENS, eos=eos)
    assert stopped.generated[-1] == eos and len(stopped.generated) < 8
    engine = Qwen3TalkerEngine(folder, text_eos_token_ids=[eos], **path_args(talker_path))
    pieces = talker_pieces(stopped, "e", "ethan", True, TALKER_TOKENS)
    pieces[-1].final = False     # the final mark comes later, empty: EOS alone ends the text
    pieces.append(EngineRequest(request_id="e", final=True))
    outs = drive(engine, {"e": pieces})["e"]
    assert torch.equal(_codes(outs), stopped.codes)


def test_sampled_is_seeded(talker, france):
    def codes(seed, rid):
        feed = talker_pieces(france, rid, "ethan", False, 12, temperature=0.9, top_k=50, seed=seed)
        return _codes(drive(talker, {rid: feed})[rid])
    a, b, c = codes(1, "s1"), codes(1, "s2"), codes(2, "s3")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, france.codes[:, :a.shape[1]])


def test_waits_for_text_and_aborts(talker, france):
    pieces = talker_pieces(france, "q", "ethan", True, TALKER_TOKENS)
    talker.add_request(pieces[0])
    talker.step()                             # prefill: the first frame
    talker.step()                             # decode step 0 takes generated id 1: not here yet
    assert not talker.has_unfinished() and talker.num_waiting() == 1
    talker.add_request(pieces[1])
    assert talker.has_unfinished()
    talker.step()
    talker.abort("q")
    assert not talker.has_open_streams() and talker.step() == []
    talker.abort("never-seen")


def test_bad_requests(talker, france):
    with pytest.raises(EngineError, match=r"unknown speaker 'bob'; known speakers: aiden, chelsie, ethan"):
        talker.add_request(EngineRequest(request_id="b", prompt_token_ids=france.prompt,
                                         voice="bob"))
    with pytest.raises(EngineError, match="assistant"):
        talker.add_request(EngineRequest(request_id="b", prompt_token_ids=france.prompt[:-3],
                                         voice="ethan"))
    with pytest.raises(EngineError, match="prompt_token_ids"):
        talker.add_request(EngineRequest(request_id="b", voice="ethan"))
    if talker.device.type == "cpu":
        with pytest.raises(EngineError, match="cannot sleep"):
            talker.sleep()
    else:                           # a GPU engine sleeps; wake it for the tests that follow
        talker.sleep()
        assert talker.is_sleeping()
        talker.wake_up()
    assert not talker.has_open_streams()


def test_step_times(talker, code2wav, france):
    """Measured on the tiny model (printed; -s shows them)."""
    t0 = time.perf_counter()
    outs = drive(talker, {"t": talker_pieces(france, "t", "ethan", False, TALKER_TOKENS)})["t"]
    frames = _codes(outs).shape[1]
    talker_ms = (time.perf_counter() - t0) * 1000 / frames
    t0 = time.perf_counter()
    code2wav.add_request(EngineRequest(request_id="t", tensors={"codes": _codes(outs)}))
    audio = torch.cat([a.tensors["audio"] for a in drive(code2wav, {"t": []})["t"]])
    rtf = (time.perf_counter() - t0) / (audio.shape[0] / 24000)
    print(f"\ntiny talker: {talker_ms:.1f} ms/frame (12.5 frames/s of audio); code2wav RTF {rtf:.3f}")
    assert frames == TALKER_TOKENS - 1


def test_bad_options_and_ids(talker, france):
    base = dict(request_id="o", prompt_token_ids=france.prompt)
    with pytest.raises(EngineError, match="top_p"):
        talker.add_request(EngineRequest(**base, overrides=SamplingOverrides(top_p=0.0)))
    with pytest.raises(EngineError, match="max_tokens >= 1"):
        talker.add_request(EngineRequest(**base, overrides=SamplingOverrides(max_tokens=0)))
    eos = talker.ids.codec_eos          # vllm-omni's talker sampling names it as stop_token_ids
    with pytest.raises(EngineError, match=rf"stop_token_ids is not supported: the talker stops at its codec's end "
                                          rf"\[{eos}\] and at no other code; got \[{eos}, 7\]"):
        talker.add_request(EngineRequest(**base, overrides=SamplingOverrides(stop_token_ids=(eos, 7))))
    talker.add_request(EngineRequest(request_id="o2", prompt_token_ids=france.prompt, final=False,
                                     overrides=SamplingOverrides(stop_token_ids=(eos,))))
    talker.abort("o2")
    with pytest.raises(EngineError, match=r"outside the thinker's vocabulary \[0, 1024\)"):
        talker.add_request(EngineRequest(**base, generated_ids=[5000]))
    talker.add_request(EngineRequest(**base, final=False))    # speaker defaults to ethan
    with pytest.raises(EngineError, match="outside"):
        talker.add_request(EngineRequest(request_id="o", generated_ids=[-1]))
    talker.abort("o")
    assert not talker.has_open_streams()


def test_processors_chain_the_engines(talker, code2wav, france):
    """thinker outputs -> processor -> talker -> processor -> code2wav, the pieces mapped as the
    orchestrator maps them (StageInput.token_ids -> prompt_token_ids, an empty final piece to close
    a streamed request): the waveform is the reference's."""
    from omni.models.qwen3_omni import processors as p
    from omni.orchestrator.types import PipelineRequest
    from omni.stage.messages import Output

    class Ctx:
        request = PipelineRequest(request_id="p", prompt_token_ids=france.prompt, voice="Ethan")

        def detokenize(self, ids):
            return ""

    def request(inp, final=False):   # the stage's default_sampling_params arrive as its overrides
        return EngineRequest(request_id="p", prompt_token_ids=inp.token_ids, tensors=dict(inp.tensors),
                             overrides=SamplingOverrides(max_tokens=TALKER_TOKENS, temperature=0.0),
                             voice=inp.voice, generated_ids=inp.generated_ids, final=final)

    talker_state, c2w_state, audio = {}, {}, []

    def run_code2wav():
        while code2wav.has_unfinished():
            audio.extend(o.tensors["audio"] for o in code2wav.step())

    def run_talker():
        while talker.has_unfinished():
            for o in talker.step():
                for inp in p.talker_to_code2wav(Ctx(), c2w_state, Output(request_id="p", tensors=o.tensors,
                                                                         finished=o.finished)):
                    code2wav.add_request(request(inp))
                if o.finished:
                    code2wav.add_request(EngineRequest(request_id="p", final=True))
                run_code2wav()

    gen = france.generated
    for i, tok in enumerate(gen):
        out = Output(request_id="p", token_ids=[tok], finished=i == len(gen) - 1)
        for inp in p.thinker_to_talker(Ctx(), talker_state, out):
            assert inp.stream
            talker.add_request(request(inp))
        run_talker()
    talker.add_request(EngineRequest(request_id="p", final=True))
    run_talker()
    wav = torch.cat(audio)
    assert wav.shape == france.wav.shape and (wav - france.wav).abs().max() < 1e-3
    assert not talker.has_open_streams() and not code2wav.has_open_streams()
