"""The vLLM engine's sleep, wake-up and EngineCore death, over a fake of vLLM's LLMEngine (no EngineCore,
no GPU: vLLM has no sleep mode on CPU), alone and under a StageWorker."""

from __future__ import annotations

import threading
import types

import pytest

from omni.config import StageConfig
from omni.engines.base import EngineError, SamplingParams
from omni.stage import messages as m
from tests.unit.test_stage_worker import dealer, enc, hello, recv
from tests.unit.test_vllm_engine import needs_vllm


class FakeLLM:
    """vLLM's LLMEngine as VllmEngine uses it: one token per live request a step; records the calls
    of sleep mode. Its sleep drops what it held, as vLLM's (mode 'abort') does."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.calls: list[tuple] = []
        self.fail_reload = False
        self.go = threading.Event()   # step() makes output once set
        self.go.set()
        self.added = threading.Event()

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = [prompt["prompt_token_ids"][-1], params.max_tokens]
        self.added.set()

    def abort_request(self, rids):
        for r in rids:
            self.reqs.pop(r, None)

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.reqs.clear()

    def wake_up(self):
        self.calls.append(("wake_up",))

    def collective_rpc(self, method, *args):
        self.calls.append(("collective_rpc", method))
        if self.fail_reload:
            raise RuntimeError("no such file")

    def step(self):
        if not self.go.wait(0.01):
            return []
        out = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            st[1] -= 1
            c = types.SimpleNamespace(token_ids=[st[0]], logprobs=None, stop_reason=None,
                                      finish_reason="length" if st[1] == 0 else None)
            out.append(types.SimpleNamespace(request_id=rid, outputs=[c], finished=st[1] == 0, prompt_token_ids=[1]))
            if st[1] == 0:
                del self.reqs[rid]
        return out


class Waiter:
    fd = None

    def wait(self, t):
        return True

    def rearm(self):
        pass

    def head_timestamp(self):
        return None

    def close(self):
        pass


def fake_engine(llm: FakeLLM | None = None):
    """A VllmEngine with its vLLM parts replaced (no __init__: that starts an EngineCore)."""
    from omni.engines.vllm.engine import VllmEngine

    e = VllmEngine.__new__(VllmEngine)
    e.label, e.platform, e._emit_prompt_ids = "thinker", "cuda", False
    e._mm_tokens, e._mm_limits, e._hidden, e._rows_on = None, {}, None, False
    e._llm, e._waiter = llm or FakeLLM(), Waiter()
    e._core_steps = types.SimpleNamespace(advanced=lambda: False, close=lambda: None)
    e._rpc_dir = None   # no ipc folder: shutdown removes none
    e.max_model_len, e.vocab_size = 1000, 1000
    e._can_sleep, e._sleeping, e._sleep_level = True, False, 0
    e._live, e._dead = {}, None
    e._steps = e._prompt_tokens = e._gen_tokens = e._aborts = 0
    e._client = types.SimpleNamespace(shutdown=lambda timeout: None,
                                      resources=types.SimpleNamespace(engine_dead=False, engine_manager=None))
    return e


def test_level_2_wake_up_reloads_the_weights_level_1_does_not():
    e = fake_engine()
    e.sleep(2)
    assert e.is_sleeping()
    e.wake_up()
    assert e._llm.calls == [("sleep", 2), ("wake_up",), ("collective_rpc", "reload_weights")]
    assert not e.is_sleeping()
    e._llm.calls.clear()
    e.sleep(1)
    e.wake_up()
    assert e._llm.calls == [("sleep", 1), ("wake_up",)]


def test_without_sleep_mode_a_wake_up_is_a_no_op_and_a_sleep_is_refused():
    """`omni wakeup` after `omni sleep --stage 0`: the stages without sleep mode are awake, not an error."""
    e = fake_engine()
    e._can_sleep = False
    e.wake_up()
    assert not e.is_sleeping() and e._llm.calls == []
    with pytest.raises(EngineError, match="sleep mode is not available here"):
        e.sleep(1)


def test_a_failed_reload_after_level_2_leaves_the_engine_asleep_naming_the_cause():
    e = fake_engine()
    e.sleep(2)
    e._llm.fail_reload = True
    with pytest.raises(EngineError, match="reloading the weights failed .RuntimeError: no such file.; it stays asleep"):
        e.wake_up()
    assert e.is_sleeping()   # requests are refused, never answered by discarded weights
    e._llm.fail_reload = False
    e.wake_up()
    assert not e.is_sleeping() and e._llm.calls[-1] == ("collective_rpc", "reload_weights")


def test_a_failed_reload_puts_vllm_back_to_sleep_so_a_later_sleep_frees_what_wake_up_took():
    """wake_up had woken vLLM (memory mapped again) before the reload failed, and the engine stayed 'asleep':
    a later sleep() returned at once, so the replica reported asleep while vLLM held the GPU memory."""
    e = fake_engine()
    e.sleep(2)
    e._llm.fail_reload = True
    with pytest.raises(EngineError, match="it stays asleep"):
        e.wake_up()
    assert e._llm.calls == [("sleep", 2), ("wake_up",), ("collective_rpc", "reload_weights"), ("sleep", 2)]
    e._llm.calls.clear()
    e.sleep(1)
    assert e.is_sleeping() and e._llm.calls == []   # vLLM sleeps already: nothing held
    e._llm.fail_reload = False
    e.wake_up()
    assert not e.is_sleeping() and e._llm.calls == [("wake_up",), ("collective_rpc", "reload_weights")]


def test_when_vllm_cannot_sleep_again_after_a_failed_reload_the_next_sleep_frees_it_at_level_2():
    class NoSecondSleep(FakeLLM):
        def sleep(self, level):
            if self.fail_reload:
                raise RuntimeError("cannot sleep")
            super().sleep(level)

    e = fake_engine(NoSecondSleep())
    e.sleep(2)
    e._llm.fail_reload = True
    with pytest.raises(EngineError, match="it stays asleep"):
        e.wake_up()
    assert e.is_sleeping()
    e._llm.fail_reload = False
    e._llm.calls.clear()
    e.sleep(1)   # vLLM is awake with its weights gone: it sleeps (level 2: nothing worth keeping)
    assert e.is_sleeping() and e._llm.calls == [("sleep", 2)]
    e.wake_up()
    assert not e.is_sleeping() and e._llm.calls[-1] == ("collective_rpc", "reload_weights")
    e._llm.calls.clear()
    e.sleep(2)
    e._llm.fail_reload = True
    with pytest.raises(EngineError):
        e.wake_up()
    e._llm.fail_reload = False
    e._llm.calls.clear()
    e.wake_up()   # straight from the failed reload: vLLM is awake, only the weights are loaded
    assert not e.is_sleeping() and e._llm.calls == [("collective_rpc", "reload_weights")]


@needs_vllm
def test_sleep_is_refused_while_requests_are_in_flight_and_they_finish():
    """vLLM's sleep aborted them and the worker never told their frontends (they hung until the
    request timeout); now SLEEP is not ok, naming how many are open, and the request completes."""
    from omni.stage.worker import StageWorker

    llm = FakeLLM()
    llm.go.clear()
    w = StageWorker(StageConfig(stage_id=0, engine="vllm", name="thinker"), fake_engine(llm), token="secret",
                    replica_id="s0r0")
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        s.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=2))))
        assert llm.added.wait(10)   # in the engine, no output yet (its step waits on `go`)
        ok, msg = w.command("SLEEP", {"level": 1}, timeout=10)
        assert not ok and "cannot sleep with 1 request(s) in flight" in msg, msg
        assert not w.engine.is_sleeping() and ("sleep", 1) not in llm.calls
        llm.go.set()
        outs = [recv(s) for _ in range(2)]
        assert [o.token_ids for o in outs] == [[11], [12]] and outs[-1].finished
        assert w.command("SLEEP", {"level": 1}, timeout=10) == (True, "sleeping")
    finally:
        s.close(0)
        w.stop()
        t.join(10)


@needs_vllm
def test_an_engine_core_found_dead_by_add_request_fails_the_requests_and_stops_the_worker():
    """add_request's liveness check raised EngineCoreDied (a RuntimeError) out of the worker's loop:
    the requests in flight were never failed and worker.close() never ran. Now the new request fails as
    unavailable (another replica takes it), those in flight fail with the cause, and the loop stops."""
    from omni.stage.worker import StageWorker

    llm = FakeLLM()
    llm.go.clear()
    engine = fake_engine(llm)
    closed = threading.Event()
    engine._client.shutdown = lambda timeout: closed.set()
    w = StageWorker(StageConfig(stage_id=0, engine="vllm", name="thinker"), engine, replica_id="s0r0")
    sent: list = []
    w._send = lambda ident, msg: sent.append(msg)
    w._handle(b"fe", m.AddRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=5)))
    assert "r1" in w._reqs and not sent
    # The EngineCore exits; vLLM's monitor has not flagged it yet (has_unfinished says nothing).
    engine.core_processes = lambda: [types.SimpleNamespace(name="EngineCore_DP0", pid=123, exitcode=-9)]
    w._handle(b"fe", m.AddRequest(request_id="r2", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=5)))
    errors = {e.request_id: e for e in sent}
    assert set(errors) == {"r1", "r2"} and all(isinstance(e, m.RequestError) for e in sent)
    assert errors["r2"].kind == "unavailable" and "EngineCoreDied" in errors["r2"].message
    assert "pid 123) killed by SIGKILL" in errors["r1"].message and errors["r1"].kind == "internal"
    assert not w._reqs and w.fatal and "EngineCoreDied" in w.fatal
    t = threading.Thread(target=w.run, kwargs={"grace_s": 5.0}, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and closed.is_set()   # stopped at once, and closed the engine


@needs_vllm
def test_vllms_own_engine_dead_error_on_add_request_is_fatal_and_moves_the_request():
    """vLLM raising EngineDeadError from add_request became an EngineError, which the worker took for the
    client's fault: a 400 'vLLM EngineCore died' and the worker went on. Now it is EngineCoreDied: the new
    request fails as unavailable (its frontend moves it), those in flight fail, and the worker stops."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from omni.stage.worker import StageWorker

    class DeadOnAdd(FakeLLM):
        def add_request(self, rid, prompt, params):
            if rid == "r2":
                raise EngineDeadError()
            super().add_request(rid, prompt, params)

    llm = DeadOnAdd()
    llm.go.clear()
    w = StageWorker(StageConfig(stage_id=0, engine="vllm", name="thinker"), fake_engine(llm), replica_id="s0r0")
    sent: list = []
    w._send = lambda ident, msg: sent.append(msg)
    w._handle(b"fe", m.AddRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=5)))
    w._handle(b"fe", m.AddRequest(request_id="r2", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=5)))
    errors = {e.request_id: e for e in sent}
    assert set(errors) == {"r1", "r2"} and all(isinstance(e, m.RequestError) for e in sent)
    assert errors["r2"].kind == "unavailable" and "EngineCoreDied" in errors["r2"].message
    assert "reported itself dead" in errors["r1"].message
    assert not w._reqs and w.fatal and "EngineCoreDied" in w.fatal


def test_an_unexpected_add_request_error_fails_that_request_only_and_the_loop_lives():
    from omni.stage.worker import StageWorker
    from tests.unit.test_stage_worker import CountEngine

    class Flaky(CountEngine):
        def add_request(self, r):
            if r.request_id == "bad":
                raise RuntimeError("boom")
            super().add_request(r)

    w = StageWorker(StageConfig(stage_id=0, engine="count", name="counter"), Flaky(), replica_id="s0r0")
    sent: list = []
    w._send = lambda ident, msg: sent.append(msg)
    try:
        w._handle(b"fe", m.AddRequest(request_id="ok", prompt_token_ids=[1]))
        w._handle(b"fe", m.AddRequest(request_id="bad", prompt_token_ids=[1]))
        assert [(e.request_id, e.kind, e.message) for e in sent] == [
            ("bad", "internal", "engine add_request failed: RuntimeError: boom")]
        assert list(w._reqs) == ["ok"] and w.fatal is None and not w._stopping.is_set()
    finally:
        w.close()


@needs_vllm
def test_a_core_step_without_output_counts_as_progress_and_a_step_with_none_does_not():
    """A prefill chunk makes no output: the EngineCore's step count (core_steps.py) is what says it moves."""
    e = fake_engine()
    e._llm.go.clear()   # the core sends nothing
    counts = iter([True, False])
    e._core_steps = types.SimpleNamespace(advanced=lambda: next(counts), close=lambda: None)
    marks = []
    e.progress_hook = lambda: marks.append(1)
    assert e.step() == [] and marks == [1]
    assert e.step() == [] and marks == [1]


CORE_SIDE = r"""
import os, sys
from vllm.v1.engine.core import EngineCore
EngineCore.step = lambda self: ({}, self.ran)
EngineCore.step_with_batch_queue = lambda self: (None, self.ran)
from omni.engines.vllm.core_steps import ENV, count_core_steps
path = os.environ[ENV]
count_core_steps()
assert ENV not in os.environ   # the core's own children get none
assert not os.path.exists(path)
print("unlinked by the core", flush=True)
core = EngineCore.__new__(EngineCore)
for ran in (True, False, True):
    core.ran = ran
    core.step()
core.step_with_batch_queue()   # ran: True
print("stepped", flush=True)
"""


@needs_vllm
def test_the_engine_core_counts_the_steps_that_ran_the_model_and_the_file_is_gone_once_shared(tmp_path):
    import os
    import subprocess
    import sys

    from omni.engines.vllm.core_steps import ENV, CoreSteps

    folder = tmp_path / "omni-stage"
    folder.mkdir()
    steps = CoreSteps(str(folder))   # the stage's own vLLM folder, swept once the stage is gone
    try:
        assert os.path.dirname(steps.path) == str(folder) and os.stat(steps.path).st_mode & 0o077 == 0
        assert not steps.advanced()
        with steps.shared():
            out = subprocess.run([sys.executable, "-c", CORE_SIDE], env={**os.environ}, capture_output=True,
                                 text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert ENV not in os.environ and not os.path.exists(steps.path)
        assert "unlinked by the core" in out.stdout
        assert steps.advanced() and not steps.advanced()   # 3 steps ran the model: one change seen
        import struct
        assert struct.unpack_from("<Q", steps._map)[0] == 3
    finally:
        steps.close()
