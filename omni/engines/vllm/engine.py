"""VllmEngine: a stage engine backed by a vLLM EngineCore in its own process.

The stage process holds vLLM's own client (`LLMEngine` in multiprocess mode:
a SyncMPClient talking ZMQ to an EngineCore process that vLLM launches and
monitors). Token ids go in and come out; tokenization stays in the frontends
(`skip_tokenizer_init`). Each step() hands back the delta token ids that the
EngineCore produced since the previous step.

Multi-modal models (Qwen3-Omni: vLLM runs its thinker) load the tokenizer, which vLLM's
processor needs to expand placeholders. Request contract (checked in mm.py):
- `prompt_token_ids`: token ids, one `<|audio_start|><|audio_pad|><|audio_end|>` per audio
  (the frontends tokenize; the single pad is expanded by vLLM to the audio tower's length).
- `tensors["audio_<i>"]`: float32 mono waveform at 16 kHz, 1-D, i = 0.. in placeholder order.
  Images and video are refused by name.
- `request.emit_prompt_ids`: the first output carries `tensors["prompt_token_ids"]` (int64),
  the prompt as vLLM expanded it.
- With `engine_args.mm_hidden_layer` (k, or "talker": the talker's accept_hidden_layer), the
  first output of a prompt with audio carries `tensors["mm_hidden"]` (float, [n_audio_positions,
  hidden]): transformers' `hidden_states[k]` at its `<|audio_pad|>` positions (hidden.py).
  Text-only prompts capture nothing.
- With `engine_args.hidden_rows_layer` (k, or "last": the last layer's output before the final
  norm), a request whose `audio_out` is true gets, on each output, `tensors["hidden_rows"]`
  (float [n, hidden]): layer k's rows of the tokens fed since, the prompt's with the first output,
  then one per generated id that was fed (an id's row comes with a later output; the last id is
  never fed). Qwen2.5-Omni's talker reads them (hidden.RowStream).

Liveness: vLLM's monitor thread marks the client dead when the EngineCore
process exits, but a blocked `get_output()` would then wait forever. So step()
waits on the output queue itself, with a short bound, and checks for death on
every wait; a dead EngineCore makes step() raise EngineCoreDied (fatal: the
stage worker fails the requests it held and the stage process exits non-zero).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from omni import fsutil, latency_trace
from omni.config import DeployConfig, StageConfig
from omni.engines.vllm import mm as vllm_mm
# The args helpers are imported from here by the factory, benchmarks and tests.
from omni.engines.vllm.args import (OMNI_ARGS, engine_arg_names, engine_config, prepare_env,  # noqa: F401
                                    split_engine_args, to_vllm_sampling)
from omni.engines.vllm.core_steps import CoreSteps
from omni.engines.vllm.outputs import OutputWaiter
from omni.engines.vllm.procs import describe_exit, engine_core_dies_with_us
from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from omni.engines.logprobs import from_vllm
from omni.errors import ConfigError

logger = logging.getLogger(__name__)

# How long one step() waits for the EngineCore's next outputs before it returns
# (so the worker can read new requests and aborts meanwhile).
STEP_WAIT_S = 0.002
SHUTDOWN_TIMEOUT_S = 3.0
UTILITY_TIMEOUT_S = 30.0


class EngineCoreDied(RuntimeError):
    """The EngineCore process is gone: no request can be served by this engine again."""

    fatal = True   # the stage worker stops and the stage process exits non-zero


@dataclass
class _Live:
    num_prompt_tokens: int
    started: bool = False
    emit_prompt_ids: bool = False
    hidden_name: str | None = None   # the mm_hidden file vLLM writes once the prefill is done
    rows: Any = None                 # a hidden.RowStream for hidden_rows
    n_tokens: int = 0                # prompt (as vLLM expanded it) + generated so far
    logprobs: int | None = None      # the request's top-k, when it asked for logprobs


class VllmEngine(Engine):
    def __init__(self, config: DeployConfig, stage: StageConfig):
        from omni.models.resolve import resolve_model

        self.label = stage.label
        vllm_args, omni_args = split_engine_args(stage.label, dict(stage.engine_args))
        self._emit_prompt_ids = bool(omni_args.get("emit_prompt_ids", False))
        model_path = resolve_model(stage.model or config.model)
        from vllm.platforms import current_platform

        self.platform = current_platform.device_name
        cpu = current_platform.is_cpu()
        self._rpc_dir = prepare_env(omni_args.get("num_threads"), cpu,
                                    vllm_args.get("kv_cache_memory_bytes") is not None)
        if cpu:
            # Compiled mode is slow to start and flaky in warm-up on CPU.
            vllm_args.setdefault("enforce_eager", True)
        vllm_args.setdefault("disable_log_stats", True)

        from vllm.v1.engine.llm_engine import LLMEngine

        from omni.engines.vllm.procs import register_models

        register_models()   # before vLLM inspects the architecture
        t0 = time.monotonic()
        engine_args, vllm_config = engine_config(stage.label, model_path, vllm_args, skip_tokenizer=True)
        self._mm_tokens: vllm_mm.MmTokens | None = None
        self._mm_limits: dict[str, int] = {}
        self._hidden = None   # a hidden.HiddenStatesReader while capture is on
        self._rows_on = False
        if vllm_config.model_config.is_multimodal_model:
            # vLLM's multi-modal processors need the tokenizer (to expand placeholders);
            # outputs stay token ids (detokenize=False per request).
            hf_config = vllm_config.model_config.hf_config
            tokens = vllm_mm.MmTokens.from_hf_config(hf_config)
            vllm_mm.default_limits(vllm_args, tokens.modalities())
            self._hidden = vllm_mm.enable_hidden_capture(stage.label, omni_args.get("mm_hidden_layer"), hf_config,
                                                         vllm_args, omni_args.get("hidden_rows_layer"))
            self._rows_on = omni_args.get("hidden_rows_layer") is not None
            engine_args, vllm_config = engine_config(stage.label, model_path, vllm_args, skip_tokenizer=False)
            self._mm_tokens = tokens
            self._mm_limits = vllm_mm.stage_limits(vllm_config, tokens.modalities())
        else:
            for k in ("mm_hidden_layer", "hidden_rows_layer"):
                if omni_args.get(k) is not None:
                    raise ConfigError(f"{stage.label}: engine_args.{k} needs a multi-modal model")
        from vllm.v1.executor import Executor

        self._core_steps = CoreSteps(self._rpc_dir)
        try:
            with engine_core_dies_with_us(), self._core_steps.shared():
                self._llm = LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                                      log_stats=not engine_args.disable_log_stats, multiprocess_mode=True)
        except BaseException:
            self._core_steps.close()
            if self._hidden is not None:
                self._hidden.close()
            raise
        self._client = self._llm.engine_core
        self._waiter = OutputWaiter(self._client.outputs_queue)
        self.load_seconds = time.monotonic() - t0
        mc = vllm_config.model_config
        self.model_path = model_path
        self.max_model_len = mc.max_model_len
        self.audio_limit = self._mm_limits.get("audio", 0)   # registered: the frontend counts audio parts by it
        self.vocab_size = mc.get_vocab_size()
        self._can_sleep = bool(mc.enable_sleep_mode)
        self._sleeping = False
        self._sleep_level = 0
        self._live: dict[str, _Live] = {}
        self._dead: str | None = None
        self._steps = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._aborts = 0
        logger.info("%s: vLLM EngineCore up in %.1f s (pid %s, %s, max_model_len %d)", self.label,
                    self.load_seconds, self.core_pids(), self.platform, self.max_model_len)

    # ---- liveness ------------------------------------------------------------------
    def core_processes(self) -> list:
        manager = getattr(self._client.resources, "engine_manager", None)
        return list(getattr(manager, "processes", []) or [])

    def core_pids(self) -> list[int]:
        return [p.pid for p in self.core_processes()]

    def _check_alive(self) -> None:
        if self._dead is None:
            gone = [p for p in self.core_processes() if p.exitcode is not None]
            if not gone and self._client.resources.engine_dead:
                # vLLM may flag the death before the exit status is there: give the cause a moment.
                for p in self.core_processes():
                    p.join(2.0)
                gone = [p for p in self.core_processes() if p.exitcode is not None]
            if gone or self._client.resources.engine_dead:
                self._dead = "; ".join(describe_exit(p) for p in gone) or "the EngineCore reported itself dead"
        if self._dead is not None:
            raise EngineCoreDied(f"{self.label}: vLLM EngineCore died: {self._dead}")

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._check_alive()
        rid = request.request_id
        if self._sleeping:
            raise EngineError("engine is sleeping")
        if rid in self._live:
            raise EngineError(f"request {rid!r} is already queued or running")
        if request.prompt_token_ids is None:
            raise EngineError(f"request {rid!r}: the vLLM stage takes prompt_token_ids (tokenization "
                              "happens in the frontends)")
        if request.tensors and self._mm_tokens is None:
            raise EngineError(f"request {rid!r}: the vLLM stage takes no input tensors for this model "
                              f"(got {sorted(request.tensors)})")
        prompt = [int(t) for t in request.prompt_token_ids]
        if not prompt:
            raise EngineError(f"request {rid!r}: the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            # An id outside the embedding table would crash the EngineCore, not the request.
            raise EngineError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        vllm_prompt: dict[str, Any] = {"prompt_token_ids": prompt}
        n_audio = 0
        if self._mm_tokens is not None:
            vllm_prompt, n_audio = vllm_mm.build_prompt(request, prompt, self._mm_tokens, self._mm_limits)
        p = request.effective_sampling()
        if p.max_tokens < 1:
            raise EngineError(f"request {rid!r}: max_tokens must be >= 1, got {p.max_tokens}")
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            params = to_vllm_sampling(p)
            hidden_name, rows = None, None
            if n_audio and self._hidden is not None:   # only prompts with audio pay for it
                hidden_name = self._hidden.new_name()
            if self._rows_on and request.audio_out:   # only requests that will speak
                rows = self._hidden.new_stream()
            if hidden_name is not None or rows is not None:
                params.extra_args = vllm_mm.hidden_request_args(hidden_name, rows and rows.stem)
            self._llm.add_request(rid, vllm_prompt, params)
        except (ValueError, VLLMClientError) as e:   # vLLM's validation (prompt too long, bad top_p, ...)
            raise EngineError(f"request {rid!r}: {e}") from None
        except EngineDeadError:
            # Fatal, as _check_alive's: the worker moves this request (unavailable) and stops.
            self._dead = self._dead or "the EngineCore reported itself dead"
            raise EngineCoreDied(f"{self.label}: vLLM EngineCore died: {self._dead}") from None
        self._live[rid] = _Live(len(prompt), emit_prompt_ids=(self._emit_prompt_ids if request.emit_prompt_ids is None
                                                                 else request.emit_prompt_ids),
                                hidden_name=hidden_name, rows=rows, logprobs=p.logprobs)
        self._prompt_tokens += len(prompt)

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        if live.hidden_name is not None and not live.started:
            self._hidden.discard(live.hidden_name)
        if live.rows is not None:
            live.rows.close()
        self._aborts += 1
        try:
            self._llm.abort_request([request_id])
        except Exception as e:  # a dead core cannot be told; step() reports the death
            logger.warning("%s: abort of %s did not reach the EngineCore: %s", self.label, request_id, e)

    def has_unfinished(self) -> bool:
        # A dead EngineCore counts as work: the worker's next step() reports the death.
        return bool(self._live) or self._dead is not None or self._client.resources.engine_dead

    def num_waiting(self) -> int:
        return sum(1 for s in list(self._live.values()) if not s.started)

    def num_running(self) -> int:
        return sum(1 for s in list(self._live.values()) if s.started)

    # ---- the step ----------------------------------------------------------------
    def ready_fd(self) -> int | None:
        return self._waiter.fd

    def step(self) -> list[EngineOutput]:
        self._check_alive()
        if self._core_steps.advanced():   # a prefill chunk sends no output (core_steps.py)
            self.progressed()
        if not self._waiter.wait(STEP_WAIT_S):
            return []
        from vllm.v1.engine.exceptions import EngineDeadError

        made_at = self._waiter.head_timestamp() if latency_trace.on() else None
        try:
            results = self._llm.step()
        except EngineDeadError as e:
            self._dead = f"{type(e).__name__}: {e}"
            self._check_alive()
            raise
        self._steps += 1
        if made_at is not None:
            for r in results:
                latency_trace.mark("core", r.request_id, 1, at=made_at)
        outputs = []
        for r in results:
            live = self._live.get(r.request_id)
            if live is None:
                continue   # aborted meanwhile
            c = r.outputs[0] if r.outputs else None
            ids = list(c.token_ids) if c is not None else []
            self._gen_tokens += len(ids)
            out = EngineOutput(request_id=r.request_id, token_ids=ids)
            if ids and live.logprobs is not None and c.logprobs:
                out.logprobs = from_vllm(ids, c.logprobs, live.logprobs)
            if not live.started:
                live.started = True
                # vLLM's prompt: audio placeholders expanded to the audio tower's output length.
                expanded = r.prompt_token_ids
                out.num_prompt_tokens = len(expanded) if expanded else live.num_prompt_tokens
                if live.emit_prompt_ids and expanded is not None:
                    out.tensors = {"prompt_token_ids": torch.tensor(expanded, dtype=torch.int64)}
                live.n_tokens = out.num_prompt_tokens
                if live.hidden_name is not None:
                    self._attach_mm_hidden(out, live.hidden_name, r.finished)
            live.n_tokens += len(ids)
            if live.rows is not None and out.error is None:
                self._attach_rows(out, live, r.finished)
            if r.finished:
                self._live.pop(r.request_id, None)
                if live.rows is not None:
                    live.rows.close()
                reason = str(c.finish_reason) if c is not None and c.finish_reason is not None else "stop"
                out.finished = True
                if out.error is None and reason == "error":
                    out.finish_reason, out.error = "error", f"vLLM failed request {r.request_id}"
                elif out.error is None:
                    out.finish_reason = reason if reason in ("stop", "length", "abort") else "stop"
                    out.stop_reason = getattr(c, "stop_reason", None)   # the stop token id, as vLLM's server sends
            outputs.append(out)
        self._waiter.rearm()
        return outputs

    def _attach_mm_hidden(self, out: EngineOutput, name: str, finished: bool) -> None:
        """The file is complete before the first token leaves vLLM's worker (hidden.py)."""
        rows = self._hidden.take(name)
        if rows is not None:
            out.tensors = {**out.tensors, "mm_hidden": rows}
            return
        if not finished:
            self.abort(out.request_id)
        out.finished, out.finish_reason = True, "error"
        out.error = out.error or f"vLLM wrote no hidden states for request {out.request_id}"

    def _attach_rows(self, out: EngineOutput, live: _Live, finished: bool) -> None:
        """Every row final so far: all fed tokens' (the newest id is not fed yet)."""
        rows = live.rows.take(live.n_tokens - 1)
        if rows is not None:
            out.tensors = {**out.tensors, "hidden_rows": rows}
        if not finished:
            return
        live.rows.close()
        if live.rows.delivered < live.n_tokens - 1:
            out.finish_reason = "error"
            out.error = (f"vLLM wrote {live.rows.delivered} of {live.n_tokens - 1} hidden rows for request "
                         f"{out.request_id}")

    # ---- utilities -----------------------------------------------------------------
    def call_core(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        """A vLLM utility call on the EngineCore, bounded in time and by its death
        (the client's own call_utility waits forever on a dead core)."""
        from vllm.v1.engine import EngineCoreRequestType

        self._check_alive()
        call_id = uuid.uuid1().int >> 64
        future: Future = Future()
        self._client.utility_results[call_id] = future
        self._client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=0.2)
            except FutureTimeout:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._client.utility_results.pop(call_id, None)
                    raise EngineError(f"vLLM utility {method} did not answer within {timeout:.0f} s") from None

    def can_sleep(self) -> bool:
        return self._can_sleep

    def _refuse_sleep(self) -> None:
        raise EngineError(
            f"{self.label}: vLLM sleep mode is not available here "
            f"(platform {self.platform}: "
            + ("vLLM has no sleep mode on this platform)" if self.platform == "cpu"
               else "start the stage with engine_args.enable_sleep_mode: true)"))

    def sleep(self, level: int = 1) -> None:
        if not self._can_sleep:
            self._refuse_sleep()
        self._check_alive()
        if self._live:
            # vLLM's sleep would abort them with no word to their frontends: refused, as every engine does.
            raise EngineError(f"{self.label} cannot sleep with {len(self._live)} request(s) in flight")
        # _sleeping: requests are refused; _sleep_level: how vLLM sleeps (0: awake, only after a failed reload
        # that could not put it back to sleep: it holds memory and its weights are gone, so level 2).
        if self._sleeping and self._sleep_level:
            return
        level = 2 if self._sleeping else level
        self._llm.sleep(level)
        self._sleep_level = level
        self._sleeping = True

    def wake_up(self) -> None:
        self._check_alive()       # without sleep mode it is never asleep: awake, as the base engine says
        if not self._sleeping:
            return
        reload = self._sleep_level in (0, 2)
        if self._sleep_level:
            self._llm.wake_up()
            self._sleep_level = 0
        if reload:
            # Level 2 discarded the weights: wake_up only maps fresh memory, so load them again from
            # the model folder. Until that works the engine stays asleep (it would answer garbage),
            # and vLLM sleeps again, so the memory wake_up took is free as `omni sleep` said.
            try:
                self._llm.collective_rpc("reload_weights")
            except Exception as e:
                try:
                    self._llm.sleep(2)
                    self._sleep_level = 2
                except Exception:
                    logger.exception("%s: back to sleep after a failed reload", self.label)
                raise EngineError(f"{self.label}: woke from sleep level 2 but reloading the weights failed "
                                  f"({type(e).__name__}: {e}); it stays asleep") from None
        self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping   # read from the keep-alive thread: no EngineCore round trip

    def stats(self) -> dict[str, float]:
        out = {
            "steps": float(self._steps),
            "prompt_tokens": float(self._prompt_tokens),
            "generated_tokens": float(self._gen_tokens),
            "aborts": float(self._aborts),
            "live_requests": float(len(self._live)),
            "load_seconds": self.load_seconds,
        }
        # Asked of the EngineCore itself: does its scheduler still hold requests?
        out["core_has_work"] = float(bool(self.call_core("has_work", timeout=10.0)))
        return out

    def shutdown(self) -> None:
        try:
            self._client.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:
            logger.exception("%s: vLLM client shutdown", self.label)
        if self._hidden is not None:
            self._hidden.close()
        self._waiter.close()
        self._core_steps.close()
        if self._rpc_dir is not None:   # vLLM's ipc sockets, which its processes leave behind
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            fsutil.forget(self._rpc_dir)
            # A later engine of this process makes a folder of its own (it named this one, now gone).
            if os.environ.get("VLLM_RPC_BASE_PATH") == self._rpc_dir:
                del os.environ["VLLM_RPC_BASE_PATH"]
