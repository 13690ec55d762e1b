"""Audio engines against tiny hand-made ONNX graphs (the real voice is in tests/e2e)."""

from __future__ import annotations

import io
import json
import shutil
import time
import wave

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from omni.audio import pcm16_bytes, wav_bytes, wav_header
from omni.engines.base import EngineError, EngineRequest, SamplingOverrides
from omni.models.piper.engines import Code2WavEngine, TalkerEngine, code2wav_request
from omni.models.piper import voice as piper_voice
from omni.models.piper.voice import find_latent_cut
from omni.models.piper.processors import talker_to_code2wav
from omni.stage.messages import Output

C = 4      # latent channels
HOP = 3    # samples per frame


def _save(nodes, inputs, outputs, inits, path):
    graph = helper.make_graph(nodes, "fake", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _fake_code2wav(path):
    # A kernel-3 conv (one frame of context each side), then each frame value
    # repeated HOP times: chunked decoding is exact once context_frames >= 1.
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, C, 3], rng.normal(size=3 * C).tolist())
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [3])
    reps = helper.make_tensor("reps", TensorProto.INT64, [4], [1, 1, 1, HOP])
    shape = helper.make_tensor("shape", TensorProto.INT64, [4], [1, 1, 1, -1])
    nodes = [
        helper.make_node("Conv", ["latents", "w"], ["c"], pads=[1, 1], name="/dec/conv"),
        helper.make_node("Unsqueeze", ["c", "axes"], ["u"]),
        helper.make_node("Tile", ["u", "reps"], ["t"]),
        helper.make_node("Reshape", ["t", "shape"], ["audio"]),
    ]
    _save(nodes, [helper.make_tensor_value_info("latents", TensorProto.FLOAT, [1, C, "T"])],
          [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, 1, "N"])],
          [w, axes, reps, shape], path)


def _fake_talker(path):
    # latents[0, c, i] = phoneme id i, so tests can read back what was sent.
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    reps = helper.make_tensor("reps", TensorProto.INT64, [3], [1, C, 1])
    nodes = [
        helper.make_node("Cast", ["input"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["f", "axes"], ["u"]),
        helper.make_node("Tile", ["u", "reps"], ["latents"]),
        helper.make_node("Identity", ["input_lengths"], ["unused_len"]),
        helper.make_node("Identity", ["scales"], ["unused_scales"]),
    ]
    _save(nodes, [helper.make_tensor_value_info("input", TensorProto.INT64, [1, "N"]),
                  helper.make_tensor_value_info("input_lengths", TensorProto.INT64, [1]),
                  helper.make_tensor_value_info("scales", TensorProto.FLOAT, [3])],
          [helper.make_tensor_value_info("latents", TensorProto.FLOAT, [1, C, "N"])],
          [axes, reps], path)


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakevoice")
    _fake_code2wav(d / piper_voice.CODE2WAV_FILE)
    _fake_talker(d / piper_voice.TALKER_FILE)
    _, config = piper_voice.locate_voice("joe")     # a real Piper config for the phonemizer
    shutil.copyfile(config, d / piper_voice.CONFIG_FILE)
    (d / piper_voice.META_FILE).write_text(json.dumps({
        "name": "fake", "source": "none", "sample_rate": 8000, "hop_length": HOP,
        "latent_channels": C}))
    return d


def _latents(frames, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(1, C, frames)).astype(np.float32))


def _run(engine, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        step = engine.step()
        if not step:
            return outs
        outs += step
    raise AssertionError("engine did not finish")


def _one_shot(voice_dir, lat):
    e = Code2WavEngine(voice_dir, chunk_frames=10_000)
    e.add_request(EngineRequest(request_id="ref", tensors={"latents": lat}))
    (out,) = _run(e)
    return out.tensors["audio"].numpy()


def test_streamed_pieces_join_to_one_shot(voice_dir):
    lat = _latents(50)
    ref = _one_shot(voice_dir, lat)
    assert ref.shape == (50 * HOP,)
    e = Code2WavEngine(voice_dir, chunk_frames=8, first_chunk_frames=3, context_frames=2)
    assert e.sample_rate == 8000
    outs = []
    cuts = [0, 1, 7, 20, 21, 50]
    for a, b in zip(cuts, cuts[1:]):
        e.add_request(EngineRequest(request_id="s", tensors={"latents": lat[:, :, a:b]},
                                    final=b == 50))
        outs += _run(e)
        if b < 50:
            # Waiting for more frames is not work: the stage loop must not spin on it.
            assert e.has_open_streams() and not e.has_unfinished() and e.step() == []
            assert e.num_waiting() == 1
    assert not e.has_open_streams()
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[0].tensors["audio"].shape == (3 * HOP,)          # the small first chunk
    joined = np.concatenate([o.tensors["audio"].numpy() for o in outs])
    np.testing.assert_allclose(joined, ref, atol=1e-5)


def test_without_context_chunks_differ(voice_dir):
    lat = _latents(30)
    e = Code2WavEngine(voice_dir, chunk_frames=5, context_frames=0)
    e.add_request(EngineRequest(request_id="s", tensors={"latents": lat}))
    joined = np.concatenate([o.tensors["audio"].numpy() for o in _run(e)])
    assert np.abs(joined - _one_shot(voice_dir, lat)).max() > 1e-3


def test_final_marker_without_latents_flushes(voice_dir):
    e = Code2WavEngine(voice_dir, chunk_frames=4, context_frames=2)
    e.add_request(EngineRequest(request_id="s", tensors={"latents": _latents(6)}, final=False))
    first = _run(e)
    assert len(first) == 1 and first[0].tensors["audio"].shape == (4 * HOP,)
    e.add_request(EngineRequest(request_id="s", final=True))
    (last,) = _run(e)
    assert last.finished and last.tensors["audio"].shape == (2 * HOP,)
    # A stream whose only piece is an empty final one ends with empty audio.
    e.add_request(EngineRequest(request_id="empty", final=True))
    (out,) = _run(e)
    assert out.finished and out.tensors["audio"].numel() == 0


def test_round_robin_between_streams(voice_dir):
    e = Code2WavEngine(voice_dir, chunk_frames=4, context_frames=1)
    for rid in ("a", "b"):
        e.add_request(EngineRequest(request_id=rid, tensors={"latents": _latents(16)}))
    order = [o.request_id for o in _run(e)]
    assert order == ["a", "b"] * 4


@pytest.mark.parametrize("tensors,fields,needle", [
    ({"latents": torch.zeros(1, C + 1, 5)}, {}, "latents must be [1, 4, T]"),
    ({"latents": torch.zeros(1, C, 5, dtype=torch.int64)}, {}, "floating point"),
    ({"latents": torch.full((1, C, 5), float("nan"))}, {}, "NaN"),
    ({}, {"final": False}, "no 'latents'"),
])
def test_code2wav_bad_input_names_the_problem(voice_dir, tensors, fields, needle):
    e = Code2WavEngine(voice_dir)
    with pytest.raises(EngineError, match="request bad: .*" + needle.replace("[", r"\[").replace("]", r"\]")):
        e.add_request(EngineRequest(request_id="bad", tensors=tensors, **fields))
    assert not e.has_open_streams()
    e.add_request(EngineRequest(request_id="ok", tensors={"latents": _latents(3)}))
    (out,) = _run(e)
    assert out.finished and out.tensors["audio"].shape == (3 * HOP,)


def test_code2wav_piece_after_final_refused_and_abort(voice_dir):
    e = Code2WavEngine(voice_dir, chunk_frames=4, context_frames=2)
    e.add_request(EngineRequest(request_id="s", tensors={"latents": _latents(3)}))
    with pytest.raises(EngineError, match="after the piece marked final"):
        e.add_request(EngineRequest(request_id="s", tensors={"latents": _latents(3)}))
    e.abort("s")
    e.abort("never-seen")
    assert not e.has_open_streams() and e.step() == []


def test_talker_one_output_per_sentence_and_feeds_code2wav(voice_dir):
    t = TalkerEngine(voice_dir)
    assert t.voice == "fake"
    t.add_request(EngineRequest(request_id="a", text="Hello there. How are you? Fine."))
    t.add_request(EngineRequest(request_id="b", text="One sentence."))
    outs = _run(t)
    assert [o.request_id for o in outs] == ["a", "b", "a", "a"]      # round-robin
    assert [o.finished for o in outs] == [False, True, False, True]
    first = outs[0]
    lat = first.tensors["latents"]
    assert lat.dtype == torch.float32 and lat.shape[:2] == (1, C)
    assert first.num_prompt_tokens > lat.shape[2]      # counts all sentences of "a"
    assert lat[0, 0, 0].item() == 1.0                  # sentences start with BOS (^ = 1)
    c = Code2WavEngine(voice_dir, chunk_frames=4, context_frames=1)
    for o in outs:
        if o.request_id == "a":
            c.add_request(code2wav_request(o))
    audio = _run(c)
    assert audio[-1].finished
    total = sum(o.tensors["latents"].shape[2] for o in outs if o.request_id == "a")
    assert sum(a.tensors["audio"].numel() for a in audio) == total * HOP


@pytest.mark.parametrize("text,fields,needle", [
    ("", {}, "empty text"),
    ("   ", {}, "empty text"),
    (None, {}, "empty text"),
    ("hi", {"voice": "nobody"}, "unknown voice 'nobody'"),
    ("hi", {"speed": 0}, "speed=0 is outside"),
    ("hi", {"overrides": SamplingOverrides(noise_scale=float("nan"))}, "noise_scale=nan"),
    ("x" * 30_000, {}, "limit is 20000"),
])
def test_talker_bad_input_names_the_problem(voice_dir, text, fields, needle):
    t = TalkerEngine(voice_dir)
    with pytest.raises(EngineError, match=needle):
        t.add_request(EngineRequest(request_id="bad", text=text, **fields))
    assert not t.has_unfinished()
    t.add_request(EngineRequest(request_id="ok", text="Still working."))
    (out,) = _run(t)
    assert out.finished and out.error is None


def test_talker_abort(voice_dir):
    t = TalkerEngine(voice_dir)
    t.add_request(EngineRequest(request_id="a", text="One. Two. Three."))
    assert len(t.step()) == 1
    t.abort("a")
    assert not t.has_unfinished() and t.step() == []


def test_talker_hold_waits_for_release_or_deadline_and_serves_others_meanwhile(voice_dir):
    t = TalkerEngine(voice_dir)
    assert t.can_hold() and t.held_until() is None
    t.add_request(EngineRequest(request_id="a", text="One. Two. Three."))
    (first,) = t.step()
    t.hold("a", time.monotonic() + 3600)
    assert not t.has_unfinished() and t.step() == [] and t.num_running() == 1
    t.add_request(EngineRequest(request_id="b", text="Other."))
    assert [o.request_id for o in t.step()] == ["b"]        # another request goes on meanwhile
    assert not t.has_unfinished() and t.held_until() > time.monotonic() + 3000
    t.release("a")
    t.release("a")                                           # twice, or unknown: ignored
    assert [o.request_id for o in _run(t)] == ["a", "a"]
    # A deadline ends a hold without a release; an abort drops a held request.
    t.add_request(EngineRequest(request_id="c", text="One. Two."))
    t.step()
    t.hold("c", time.monotonic() - 1)
    assert t.has_unfinished() and [o.request_id for o in t.step()] == ["c"]
    t.add_request(EngineRequest(request_id="d", text="One. Two."))
    t.step()
    t.hold("d", time.monotonic() + 3600)
    t.abort("d")
    assert t.held_until() is None and not t.has_unfinished() and t.num_running() == 0


def test_find_latent_cut():
    def node(name, ins, outs):
        return helper.make_node("Identity", ins, outs, name=name)
    g = helper.make_graph([node("/enc/a", ["x"], ["z"]), node("/dec/b", ["z"], ["y"]),
                           node("/dec/c", ["y"], ["w"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])])
    assert find_latent_cut(g) == "z"
    g.node.append(node("/enc/d", ["x"], ["q"]))
    g.node.append(node("/dec/e", ["q"], ["r"]))
    with pytest.raises(Exception, match="expected one tensor"):
        find_latent_cut(g)


def test_unknown_voice_lists_builtins():
    with pytest.raises(Exception, match="unknown voice 'zed'; built-in voices: joe"):
        piper_voice.prepare_voice("zed")


def test_wav_bytes_round_trip():
    pcm = np.array([0.0, 0.5, -0.5, 1.5, -2.0], dtype=np.float32)
    data = wav_bytes(pcm, 22050)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (22050, 1, 2, 5)
        samples = np.frombuffer(w.readframes(5), dtype="<i2")
    assert samples.tolist() == [0, 16384, -16384, 32767, -32767]       # rounded, clipped at +-1
    assert pcm16_bytes(torch.from_numpy(pcm)) == data[44:]
    assert len(wav_header(16000)) == 44 and wav_header(16000)[40:44] == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError, match="float samples"):
        pcm16_bytes(np.zeros(3, dtype=np.int16))
    with pytest.raises(ValueError, match="mono"):
        pcm16_bytes(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="sample_rate"):
        wav_header(0)


def test_piper_stages_run_torch_on_their_own_threads():
    """A stage's shared-memory copies are torch ops: on a pool as wide as the host, its idle
    workers spin after each copy and take CPU from the next stage (speech's first chunk)."""
    from omni.config import StageConfig
    from omni.engines.factory import cpu_stage_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_stage_threads(StageConfig(stage_id=2, engine="piper_code2wav"))
        assert torch.get_num_threads() == 1
        cpu_stage_threads(StageConfig(stage_id=2, engine="piper_code2wav", engine_args={"threads": 2}))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_talker_upstream_sentence_with_nothing_to_speak_is_zero_audio(voice_dir):
    """A thinker's sentence (the orchestrator's sub-request rid/sN) that is all punctuation finishes
    with no latents, so the chat answers normally; the client's own text stays an error (a 400)."""
    t = TalkerEngine(voice_dir)
    with pytest.raises(EngineError, match="nothing to speak"):
        t.add_request(EngineRequest(request_id="speech-1", text="..."))
    t.add_request(EngineRequest(request_id="chat-1/s2", text="?!"))
    (out,) = _run(t)
    assert (out.request_id, out.finished, out.finish_reason, out.error, out.tensors) == ("chat-1/s2", True, "stop", None, {})
    assert talker_to_code2wav(None, {}, Output(request_id="chat-1/s2", finished=True)) == []
    assert not t.has_unfinished() and t.num_waiting() == 0
