"""Qwen3-Omni code2wav streaming, stage weight loading and the pipeline processors (tiny model)."""

from __future__ import annotations

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest
from tests.unit.qwen3_ref import drive

pytest.importorskip("transformers")

T = 120


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from omni.models.qwen3_omni import tiny as qwen3_omni_tiny

    torch.set_num_threads(1)
    return qwen3_omni_tiny.build(tmp_path_factory.mktemp("qwen3_tiny"))


@pytest.fixture(scope="module")
def engine(folder, device):
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    return Qwen3Code2WavEngine(folder, device=device)


def _decode(engine, codes):
    """The whole decode on the engine's device (the codes arrive on the CPU)."""
    with torch.no_grad():
        return engine.model(codes[None].to(engine.device)).reshape(-1).cpu()


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 2048, (16, T), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def whole(engine, codes):
    return _decode(engine, codes)


def _pieces(rid, codes, sizes):
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(EngineRequest(request_id=rid, tensors={"codes": codes[:, at:at + n]},
                                 final=i == len(sizes) - 1))
        at += n
    assert at == codes.shape[1]
    return out


def _audio(outs):
    return torch.cat([o.tensors["audio"] for o in outs])


def _chunked_decode_error(engine, codes, whole, sizes, context=25):
    """transformers' / vllm-omni's chunking: decode [start - context, end), keep from frame `start`."""
    parts, start = [], 0
    for n in sizes:
        lo = max(0, start - context)
        parts.append(_decode(engine, codes[:, lo:start + n])[(start - lo) * engine.hop:])
        start += n
    joined = torch.cat(parts)
    m = min(joined.shape[0], whole.shape[0])
    rms = ((joined[:m] - whole[:m]).pow(2).mean().sqrt() / whole.pow(2).mean().sqrt()).item()
    return (joined[:m] - whole[:m]).abs().max().item(), rms, whole.shape[0] - joined.shape[0]


@pytest.mark.parametrize("sizes", [[4, 25, 25, 25, 25, 16], [1] * T, [7, 50, 63], [60, 60]],
                         ids=["4+25s", "one-frame", "7-50-63", "60-60"])
def test_streamed_equals_whole_decode(engine, codes, whole, sizes):
    audio = _audio(drive(engine, {"s": _pieces("s", codes, sizes)})["s"])
    assert audio.shape == whole.shape
    err = (audio - whole).abs().max().item()
    assert err < 1e-4
    # The same chunk edges the other way; one-frame pieces reach the engine's decodes as 4, 25, ...
    edges = [4, 25, 25, 25, 25, 16] if len(sizes) > 20 else sizes
    c_err, c_rms, c_lost = _chunked_decode_error(engine, codes, whole, edges)
    print(f"\n{edges}: tail-aware max|err| {err:.2e}; chunked_decode-style max|err| {c_err:.2e}, "
          f"rms {c_rms:.1%}, {c_lost} samples lost")
    assert c_err > 10 * err


@pytest.mark.parametrize("context", [1, 2])
def test_the_least_context_still_streams_every_sample(folder, device, codes, whole, context):
    """A chunk re-decodes the tail the previous one held back (`lost` samples, under a frame) from its left
    context: with one frame the stream is as long as the whole decode (only the attention's history differs)."""
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    engine = Qwen3Code2WavEngine(folder, device=device, context_frames=context, chunk_frames=5, first_chunk_frames=2)
    audio = _audio(drive(engine, {"s": _pieces("s", codes, [2] + [1] * (T - 2))})["s"])
    assert audio.shape == whole.shape
    assert (audio - whole).pow(2).mean().sqrt() < 0.02 * whole.pow(2).mean().sqrt()


def test_no_left_context_is_refused(folder):
    """context_frames 0 started each chunk `lost` samples before its window: only its last 555 samples came out
    (66090 of 114645 for 60 frames); vllm-omni's codec_left_context_frames: 0 reached it."""
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    with pytest.raises(ValueError, match="context_frames >= 1"):
        Qwen3Code2WavEngine(folder, context_frames=0)


def test_one_piece_is_exactly_the_whole_decode(engine, codes, whole):
    audio = _audio(drive(engine, {"w": _pieces("w", codes, [T])})["w"])
    assert torch.equal(audio, whole)


def test_stream_false_decodes_each_utterance_whole_at_its_end(folder, device, codes, whole):
    """vllm-omni's async_chunk: false: one decode of the whole utterance (longer than max_frames too)."""
    from omni.models.qwen3_omni.code2wav import Qwen3Code2WavEngine

    engine = Qwen3Code2WavEngine(folder, device=device, stream=False, max_frames=50)
    outs = drive(engine, {"w": _pieces("w", codes, [4, 25, 25, 66])})["w"]
    assert [o.tensors["audio"].numel() > 0 for o in outs] == [True]
    assert torch.equal(_audio(outs), _decode(engine, codes)) and torch.equal(_audio(outs), whole)


def test_concurrent_streams_batch(engine, codes, whole):
    other = torch.flip(codes, dims=[1])
    other_whole = _decode(engine, other)
    before = engine.stats().get("batched", 0)
    sizes = [4, 25, 25, 25, 25, 16]
    outs = drive(engine, {"a": _pieces("a", codes, sizes), "b": _pieces("b", other, sizes)})
    assert (_audio(outs["a"]) - whole).abs().max() < 1e-4
    assert (_audio(outs["b"]) - other_whole).abs().max() < 1e-4
    assert engine.stats()["batched"] > before


def test_bad_pieces(engine, codes):
    with pytest.raises(EngineError, match=r"codes must be int64 \[16, n\]"):
        engine.add_request(EngineRequest(request_id="x", tensors={"codes": codes[:8]}))
    with pytest.raises(EngineError, match=r"in \[0, 2048\)"):
        engine.add_request(EngineRequest(request_id="x", tensors={"codes": codes + 2048}))
    with pytest.raises(EngineError, match="only a final piece"):
        engine.add_request(EngineRequest(request_id="x", final=False))
    engine.add_request(EngineRequest(request_id="x", tensors={"codes": codes[:, :3]}, final=False))
    assert not engine.has_unfinished() and engine.num_waiting() == 1   # waits for its first 4 frames
    engine.abort("x")
    assert not engine.has_open_streams()
    # A stream closed with no codes at all ends with an empty chunk.
    outs = drive(engine, {"e": [EngineRequest(request_id="e", final=True)]})["e"]
    assert outs[-1].finished and outs[-1].tensors["audio"].numel() == 0


def test_stage_weights_only_their_prefix(folder):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni.models.qwen3_omni import weights

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    _, talker, embed = weights.load_talker(folder)
    _, c2w = weights.load_code2wav(folder)
    for mine, theirs in ((talker, full.talker), (c2w, full.code2wav)):
        ref = theirs.state_dict()
        got = mine.state_dict()
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert torch.equal(embed, full.thinker.model.embed_tokens.weight)
    with pytest.raises(EngineError, match="no tensors named nope"):
        weights.load_prefix(folder, "nope.")


def test_processors():
    from omni.models.qwen3_omni import processors as p
    from omni.orchestrator.types import PipelineRequest
    from omni.stage.messages import Output
    from omni.transport.base import TensorRef

    class Ctx:
        request = PipelineRequest(request_id="r", prompt_token_ids=[1, 2, 3], voice="Chelsie")

        def detokenize(self, ids):
            return ""

    state: dict = {}
    first = p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[7]))
    assert len(first) == 1 and first[0].stream
    assert first[0].token_ids == [1, 2, 3] and (first[0].voice, first[0].generated_ids) == ("Chelsie", [7])
    assert p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[])) == []
    later = p.thinker_to_talker(Ctx(), state, Output(request_id="r", token_ids=[8, 9], finished=True))
    assert (later[0].voice, later[0].generated_ids) == (None, [8, 9]) and later[0].token_ids is None and later[0].stream
    held: dict = {}
    Ctx.request = PipelineRequest(request_id="r", prompt_token_ids=[1, 2], num_audio_inputs=1)
    assert p.thinker_to_talker(Ctx(), held, Output(request_id="r", token_ids=[5])) == []
    rows = TensorRef(transport="shm", endpoint="seg", key=2, dtype="float32", shape=(3, 64), nbytes=768)
    first = p.thinker_to_talker(Ctx(), held, Output(request_id="r", token_ids=[6], tensors={"mm_hidden": rows}))
    assert (first[0].voice, first[0].generated_ids) == ("ethan", [5, 6]) and first[0].tensors == {"mm_hidden": rows}
    ref = TensorRef(transport="shm", endpoint="seg", key=1, dtype="int64", shape=(16, 4), nbytes=512)
    out = p.talker_to_code2wav(Ctx(), {}, Output(request_id="r", tensors={"codes": ref}))
    assert out[0].tensors == {"codes": ref} and out[0].stream
    assert p.talker_to_code2wav(Ctx(), {}, Output(request_id="r", finished=True)) == []


def test_factory_builds_both_engines(folder):
    from omni.config import DeployConfig, StageConfig
    from omni.engines.factory import build_engine
    from omni.errors import ConfigError

    stages = (StageConfig(stage_id=0, engine="qwen3_talker", engine_args={"chunk_frames": 10}),
              StageConfig(stage_id=1, engine="qwen3_code2wav", engine_args={"context_frames": 30}),
              StageConfig(stage_id=2, engine="qwen3_code2wav", engine_args={"context": 30}))
    config = DeployConfig(model=str(folder), stages=stages)
    assert build_engine(config, stages[0]).chunk_frames == 10
    assert build_engine(config, stages[1]).context_frames == 30
    with pytest.raises(ConfigError, match="context"):
        build_engine(config, stages[2])


def test_sleep_frees_the_device_and_wakes_to_the_same_audio(engine, codes, whole):
    if engine.device.type == "cpu":
        with pytest.raises(EngineError, match="qwen3_code2wav on CPU cannot sleep"):
            engine.sleep()
        return
    engine.sleep()
    assert engine.is_sleeping() and next(engine.model.parameters()).device.type == "cpu"
    with pytest.raises(EngineError, match="asleep"):
        engine.add_request(EngineRequest(request_id="z", tensors={"codes": codes}))
    engine.wake_up()
    assert next(engine.model.parameters()).device.type == engine.device.type     # cuda:0 vs cuda
    assert torch.equal(_audio(drive(engine, {"z": _pieces("z", codes, [T])})["z"]), whole)
