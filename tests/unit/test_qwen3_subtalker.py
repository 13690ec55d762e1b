"""The Qwen3 talker's `subtalker_sampling_params` (vllm-omni's: the code predictor's do_sample / temperature /
top_k / top_p) on the tiny model: its greedy settings give the greedy residual codes, another setting changes
a seeded request's codes, and the static step and the eager path draw the same codes with it."""

from __future__ import annotations

import pytest
import torch

from omni.errors import ConfigError
from tests.unit.qwen3_ref import drive, talker_pieces
from tests.unit.test_qwen3_talker import folder, ref  # noqa: F401 (the tiny model and its reference, shared)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

HOT = {"do_sample": True, "temperature": 2.0, "top_k": 0, "top_p": 1.0}


def engine(folder, params=None, **kw):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    return Qwen3TalkerEngine(folder, subtalker_sampling_params=params, max_num_seqs=4, **kw)


@pytest.fixture(scope="module")
def default(folder):
    return engine(folder)


@pytest.fixture(scope="module")
def frame(default):
    """Three rows of a frame whose code 0 was sampled: hidden, code 0, greedy (none), the rows' uniforms."""
    g = torch.Generator().manual_seed(3)
    dev = default._static.dev
    return (torch.randn(3, dev.codec_head.shape[1], generator=g), torch.tensor([5, 700, 2149]),
            torch.tensor([False, False, False]), torch.rand(3, dev.groups, generator=g))


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)


@pytest.mark.parametrize("params", [{"temperature": 0}, {"do_sample": False}, {"top_k": 1},
                                    {"do_sample": False, "temperature": 0.9}])
def test_a_greedy_setting_gives_the_greedy_residual_codes(folder, default, frame, params):
    """Sampled rows (code 0 sampled, uniforms given) take the argmax residual codes, on both paths."""
    from omni.models.qwen3_omni.codes import residual_codes, residual_pick

    h, code0, greedy, u = frame
    with torch.no_grad():
        want, want_sum = residual_codes(default.talker, h, code0, greedy, None)      # every row greedy
        sampled, _ = residual_codes(default.talker, h, code0, greedy, u)
        eager, eager_sum = residual_codes(default.talker, h, code0, greedy, u, residual_pick(params))
        static, static_sum = engine(folder, params)._static.dev.residual(h, code0, u, greedy)
    assert not torch.equal(sampled, want)          # the default samples these rows
    assert torch.equal(eager, want) and torch.equal(static, want)
    assert torch.allclose(eager_sum, want_sum, rtol=0, atol=1e-6)
    assert torch.allclose(static_sum, want_sum, rtol=0, atol=1e-6)


def test_another_setting_changes_the_codes_the_same_on_both_paths(folder, default, frame):
    from omni.models.qwen3_omni.codes import RESIDUAL, Pick, residual_codes, residual_pick

    assert default.residual == RESIDUAL and residual_pick(HOT) == Pick(2.0, 0, 1.0)
    h, code0, greedy, u = frame
    hot = engine(folder, HOT)
    with torch.no_grad():
        before, _ = default._static.dev.residual(h, code0, u, greedy)
        static, static_sum = hot._static.dev.residual(h, code0, u, greedy)
        eager, eager_sum = residual_codes(hot.talker, h, code0, greedy, u, hot.residual)
    assert not torch.equal(static, before)
    assert torch.equal(static, eager) and torch.allclose(static_sum, eager_sum, rtol=0, atol=1e-6)


def test_a_seeded_request_through_the_engine(folder, default, ref):
    """The engine arg reaches a seeded request's codes: the first frame keeps its code 0 (the request's own
    sampling) and takes other residual codes; the static step and the eager path agree."""
    france = ref.run("What is the capital of France?", "Ethan", talker_tokens=12)

    def feeds():
        return {"s": talker_pieces(france, "s", "ethan", False, 12, temperature=0.9, top_k=50, seed=7)}

    base = _codes(drive(default, feeds())["s"])
    hot = _codes(drive(engine(folder, HOT), feeds())["s"])
    assert torch.equal(hot, _codes(drive(engine(folder, HOT, static_decode=False), feeds())["s"]))
    assert hot[0, 0] == base[0, 0] and not torch.equal(hot[1:, 0], base[1:, 0])
    greedy = _codes(drive(engine(folder, {"temperature": 0}), feeds())["s"])
    assert greedy[0, 0] == base[0, 0] and not torch.equal(greedy[:, 0], base[:, 0])


def test_cuda_graphs_replay_the_setting(folder, ref, gpu):
    """On a GPU (real or emulated): the code predictor's setting is a constant of the captured step; the
    graphed static step draws a seeded request's codes as the eager path does with it."""
    france = ref.run("What is the capital of France?", "Ethan", talker_tokens=12)

    def feeds():
        return {"s": talker_pieces(france, "s", "ethan", True, 12, temperature=0.9, top_k=50, seed=5)}

    graphed = engine(folder, HOT, device="cuda", dtype="float32")
    assert graphed._static.graphs is not None
    got = _codes(drive(graphed, feeds())["s"])
    want = _codes(drive(engine(folder, HOT, device="cuda", dtype="float32", static_decode=False), feeds())["s"])
    assert torch.equal(got, want)
    default = _codes(drive(engine(folder, device="cuda", dtype="float32"), feeds())["s"])
    assert not torch.equal(got, default)


@pytest.mark.parametrize("params, message", [
    ({"min_p": 0.1}, "subtalker_sampling_params.min_p: not supported"),
    ({"top_p": 1.5}, "subtalker_sampling_params.top_p must be in (0, 1], got 1.5"),
    ("hot", "subtalker_sampling_params must be a mapping"),
])
def test_the_engine_refuses_what_the_config_would(params, message):
    from omni.models.qwen3_omni.codes import residual_pick

    with pytest.raises(ConfigError) as e:
        residual_pick(params)
    assert message in str(e.value)
