import pytest
import torch

from omni import config as cfg
from omni.engines.base import EngineError, EngineRequest
from omni.engines.factory import build_engine
from omni.engines.pooler import HiddenPoolerEngine
from omni.errors import ConfigError


def piece(rid: str, final: bool) -> EngineRequest:
    return EngineRequest(request_id=rid, tensors={"hidden_states": torch.ones(2, 4)}, final=final)


def test_an_engine_arg_the_pooler_does_not_take_is_refused_by_name():
    typo = {"1": {"engine_args": {"typo_argument": 7}}}
    with pytest.raises(ConfigError, match="typo_argument"):     # at load (config_engines)
        cfg.load("local", "lm-pooler", typo)
    config = cfg.load("local", "lm-pooler", typo, engines=False)
    with pytest.raises(ConfigError, match="typo_argument"):     # and at the build, for a config not checked
        build_engine(config, config.stage(1))
    plain = cfg.load("local", "lm-pooler")
    assert isinstance(build_engine(plain, plain.stage(1)), HiddenPoolerEngine)


def test_a_piece_after_the_final_one_fails_that_request_only():
    e = HiddenPoolerEngine()
    e.add_request(piece("r", final=False))
    e.add_request(piece("r", final=True))
    with pytest.raises(EngineError, match="after the piece marked final"):
        e.add_request(piece("r", final=True))
    e.add_request(piece("other", final=True))
    outs = {o.request_id: o for o in e.step()}
    assert set(outs) == {"r", "other"} and all(o.finished and o.error is None for o in outs.values())
    assert torch.allclose(outs["r"].tensors["embedding"], torch.full((4,), 0.5))
    assert not e.has_unfinished()
