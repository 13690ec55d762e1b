"""Qwen2.5-Omni token2wav streamed in blocks against a whole decode of the same codes and seed
(tiny model, float32), and the whole decode (`stream: false`) against transformers' own
`Qwen2_5OmniToken2WavModel.forward` after `torch.manual_seed(seed)`."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingOverrides, SamplingParams
from tests.unit.qwen3_ref import drive

pytest.importorskip("transformers")

N = 125                 # codes: 12 + 3 x 36 + 5 with the default blocks
HOP = 2 * 240           # samples per code
# Measured on this model (docs/architecture.md): max |streamed - whole| 9.5e-8, rms 6.2e-7 relative.
MAX_ERR, RMS_ERR = 1e-6, 5e-6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.qwen25_omni import tiny as qwen25_omni_tiny

    torch.set_num_threads(1)
    return qwen25_omni_tiny.build(tmp_path_factory.mktemp("qwen25_tiny"))


def _engine(folder, **kw):
    from omni.models.qwen25_omni.token2wav import Qwen25Token2WavEngine

    return Qwen25Token2WavEngine(folder, **kw)


@pytest.fixture(scope="module")
def streamed(folder, device):
    return _engine(folder, device=device)


@pytest.fixture(scope="module")
def whole_engine(folder, device):
    return _engine(folder, device=device, stream=False)


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 8193, (N,), generator=torch.Generator().manual_seed(0))


def _pieces(rid, codes, size, seed=3, speaker="chelsie", final=True):
    out = []
    for at in range(0, codes.shape[0], size):
        last = at + size >= codes.shape[0]
        out.append(EngineRequest(request_id=rid, tensors={"codes": codes[None, at:at + size]},
                                 sampling=SamplingParams(seed=seed), final=final and last,
                                 voice=speaker if at == 0 else None))
    return out


def _audio(outs):
    return torch.cat([o.tensors["audio"] for o in outs])


@pytest.fixture(scope="module")
def whole(whole_engine, codes):
    return _audio(drive(whole_engine, {"w": _pieces("w", codes, N)})["w"])


def _errors(got, want):
    d = got - want
    return d.abs().max().item(), (d.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def test_whole_option_is_transformers_forward_exactly(folder, whole_engine, codes, whole):
    """`stream: false` is the decode the engine always did: transformers' forward, bit for bit. On CUDA,
    transformers draws its noise from the CUDA generator and omni from the CPU one: the CPU decode's."""
    if whole_engine.device.type != "cpu":
        cpu = _audio(drive(_engine(folder, stream=False), {"c": _pieces("c", codes, N)})["c"])
        assert (whole - cpu).abs().max() < 1e-4
        return
    cond, ref_mel = whole_engine.speakers["chelsie"]
    before = torch.random.get_rng_state()
    torch.manual_seed(3)
    with torch.no_grad():
        want = whole_engine.model(codes[None], cond[None], ref_mel).reshape(-1)
    torch.random.set_rng_state(before)
    assert torch.equal(whole, want)
    pieces = drive(whole_engine, {"p": _pieces("p", codes, 25)})["p"]
    assert len(pieces) == 1 and torch.equal(pieces[0].tensors["audio"], want)     # once, at the end


@pytest.mark.parametrize("size", [5, 1, N, 25], ids=["5s", "one-code", "one-piece", "25s"])
def test_streamed_equals_whole_within_the_measured_bound(streamed, codes, whole, size):
    outs = drive(streamed, {"s": _pieces("s", codes, size)})["s"]
    audio = _audio(outs)
    assert audio.shape == whole.shape == (N * HOP,)
    err, rms = _errors(audio, whole)
    print(f"\npieces of {size}: max|streamed - whole| {err:.2e}, rms {rms:.2e} of the whole's")
    assert err < MAX_ERR and rms < RMS_ERR
    # The blocks are the same however the codes arrive, and audio comes before the end.
    assert [o.tensors["audio"].numel() // HOP for o in outs if o.tensors["audio"].numel()] == [12, 36, 36, 36, 5]
    assert torch.equal(audio, _audio(drive(streamed, {"o": _pieces("o", codes, 7)})["o"]))


def test_first_audio_after_the_first_block(streamed, codes):
    need = streamed.first_block_codes + streamed.right_context
    got = []
    for i in range(need):
        streamed.add_request(EngineRequest(request_id="f", tensors={"codes": codes[None, i:i + 1]},
                                           sampling=SamplingParams(seed=3), final=False))
        got += streamed.step()
        assert (got == []) == (i < need - 1)
    (first,) = got
    assert first.tensors["audio"].shape == (12 * HOP,) and not first.finished
    assert streamed.has_open_streams() and not streamed.has_unfinished() and streamed.num_waiting() == 1
    streamed.abort("f")
    assert not streamed.has_open_streams()


def test_abort_mid_stream_then_the_same_id_starts_afresh(streamed, codes, whole):
    pieces = _pieces("a", codes, 30)
    outs = []
    for p in pieces[:2]:
        streamed.add_request(p)
        outs += streamed.step()
    assert outs and not outs[-1].finished
    streamed.abort("a")
    assert not streamed.has_open_streams() and streamed.step() == []
    again = _audio(drive(streamed, {"a": _pieces("a", codes, 30)})["a"])
    assert _errors(again, whole)[0] < MAX_ERR


def test_seeded_and_independent_of_other_streams(streamed, codes):
    before = torch.random.get_rng_state()
    alone = _audio(drive(streamed, {"x": _pieces("x", codes, 10, seed=7)})["x"])
    assert torch.equal(alone, _audio(drive(streamed, {"x": _pieces("x", codes, 10, seed=7)})["x"]))
    batched = streamed.stats().get("batched", 0)
    crowd = drive(streamed, {"y": _pieces("y", codes.flip(0), 10, seed=1, speaker="ethan"),
                             "x": _pieces("x", codes, 10, seed=7)})
    assert streamed.stats()["batched"] > batched         # equal windows of both decoded in one batch
    assert (_audio(crowd["x"]) - alone).abs().max() < MAX_ERR
    # The stage's own seed (deploy default_sampling_params) wins over the request's.
    staged = _pieces("s", codes, 10, seed=8)
    staged[0] = msgspec.structs.replace(staged[0], overrides=SamplingOverrides(seed=7))
    assert torch.equal(_audio(drive(streamed, {"s": staged})["s"]), alone)
    other = _audio(drive(streamed, {"z": _pieces("z", codes, 10, seed=8)})["z"])
    assert (other - alone).abs().max() > 1e-3
    assert torch.equal(torch.random.get_rng_state(), before)      # the process RNG is never drawn


def test_empty_and_short_streams(streamed, whole_engine, codes):
    for engine in (streamed, whole_engine):
        outs = drive(engine, {"e": [EngineRequest(request_id="e", final=True)]})["e"]
        assert len(outs) == 1 and outs[0].finished and outs[0].tensors["audio"].numel() == 0
        short = _audio(drive(engine, {"s": _pieces("s", codes[:3], 3)})["s"])
        assert short.shape == (3 * HOP,)
    want = _audio(drive(whole_engine, {"s": _pieces("s", codes[:3], 3)})["s"])
    assert _errors(short, want)[0] < MAX_ERR


@pytest.mark.parametrize("key, value, message", [
    ("first_block_codes", 0, "first_block_codes must be an integer >= 1, got 0"),
    ("block_codes", 2.5, "block_codes must be an integer >= 1, got 2.5"),
    ("left_context", -1, "left_context must be an integer >= 0, got -1"),
    ("right_context", True, "right_context must be an integer >= 0, got True"),
    ("vocoder_context", "8", "vocoder_context must be an integer >= 0, got '8'"),
    ("stream", "yes", "stream must be true or false, got 'yes'"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
    ("block_codes", 16384, r"block_codes \+ right_context must fit the DiT's 16384 codes"),
])
def test_bad_args_are_refused_by_name(folder, key, value, message):
    with pytest.raises(ValueError, match=message):
        _engine(folder, **{key: value})


def test_factory_passes_the_stream_args(folder):
    from omni.config import DeployConfig, StageConfig
    from omni.engines.factory import build_engine
    from omni.errors import ConfigError

    stages = (StageConfig(stage_id=2, engine="qwen25_token2wav",
                          engine_args={"first_block_codes": 6, "block_codes": 24, "stream": False}),
              StageConfig(stage_id=3, engine="qwen25_token2wav", engine_args={"block_frames": 4}))
    config = DeployConfig(model=str(folder), stages=stages)
    engine = build_engine(config, stages[0])
    assert (engine.first_block_codes, engine.block_codes, engine.stream) == (6, 24, False)
    with pytest.raises(ConfigError, match="block_frames"):
        build_engine(config, stages[1])


def test_bad_pieces(streamed):
    with pytest.raises(EngineError, match=r"codes must be int64 \[1, n\]"):
        streamed.add_request(EngineRequest(request_id="b", tensors={"codes": torch.zeros(2, 3, dtype=torch.long)}))
    with pytest.raises(EngineError, match="only a final piece"):
        streamed.add_request(EngineRequest(request_id="b", final=False))
    with pytest.raises(EngineError, match="seed must be an integer"):
        streamed.add_request(EngineRequest(request_id="b", tensors={"codes": torch.tensor([1])},
                                           sampling=SamplingParams(seed="x")))
    assert not streamed.has_open_streams()


def test_sleep_frees_the_device_and_wakes_to_the_same_audio(streamed, codes):
    if streamed.device.type == "cpu":
        with pytest.raises(EngineError, match="qwen25_token2wav on CPU cannot sleep"):
            streamed.sleep()
        return
    before = _audio(drive(streamed, {"z": _pieces("z", codes, 25)})["z"])
    streamed.sleep()
    assert next(streamed.model.parameters()).device.type == "cpu"
    assert {t.device.type for pair in streamed.speakers.values() for t in pair} == {"cpu"}
    streamed.wake_up()
    assert torch.equal(_audio(drive(streamed, {"z": _pieces("z", codes, 25)})["z"]), before)


def test_audio_is_float32_1d_on_the_cpu(streamed, whole_engine, codes):
    """StreamedVocoder.decode's contract, as Qwen3's code2wav keeps it: on CUDA both decodes left the
    audio on the device. (The emulator's BigVGAN output lands on the CPU: a hook puts it on the device,
    as a GPU's is.)"""
    for engine, size in ((streamed, 25), (whole_engine, N)):
        vocoder = engine.model.code2wav_bigvgan_model
        hook = vocoder.register_forward_hook(lambda module, args, out, device=engine.device: out.to(device))
        try:
            outs = drive(engine, {"cpu": _pieces("cpu", codes, size)})["cpu"]
        finally:
            hook.remove()
        for o in outs:
            a = o.tensors["audio"]
            assert (a.device.type, a.dtype, a.dim()) == ("cpu", torch.float32, 1)
