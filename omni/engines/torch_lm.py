"""TorchLMEngine: a real causal LM on CPU with continuous batching.

Each step() admits waiting requests into free KV slots and prefills them (one
prompt at a time; each gets its first token), then runs one batched decode
forward for every request that was already running. Requests join and leave
at step boundaries; a finished or aborted request frees its slot at once.

Hidden states (emit_hidden_states=True): every output carries the final-norm
hidden states of the positions computed in that step: the whole prompt on the
first output, then one row per decode step (the position of the token fed in).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest, SamplingParams
from omni.engines.logprobs import MAX_LOGPROBS, from_logits
from omni.engines.torch_lm_model import DTYPES, BatchedLM
from omni.engines.torch_lm_sampling import sample
from omni.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


class TorchLMEngine(Engine):
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", max_num_seqs: int = 8,
                 max_model_len: int = 2048, emit_hidden_states: bool = False, num_threads: int = 1,
                 seed: int = 0):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        torch.set_num_threads(num_threads)
        self.model_path = model_path
        self.dtype_name = dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.emit_hidden_states = emit_hidden_states
        self._rng = torch.Generator().manual_seed(seed)
        t0 = time.monotonic()
        self._lm: BatchedLM | None = self._load()
        self.load_seconds = time.monotonic() - t0
        logger.info("loaded %s (%s) in %.1f s; KV cache %.0f MiB", model_path, dtype,
                    self.load_seconds, self._lm.cache_bytes() / 2**20)
        self.vocab_size = self._lm.vocab_size
        self.eos_token_ids = _eos_ids(self._lm.model)
        self._tokenizer = None
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}            # slot -> seq
        self._ids: set[str] = set()
        self._sleep_level = 0
        self._steps = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._step_ms_last = 0.0
        self._step_ms_total = 0.0

    def _load(self) -> BatchedLM:
        lm = BatchedLM(self.model_path, DTYPES[self.dtype_name], self.max_num_seqs, self.max_model_len)
        # A CPU prefill of max_model_len can outlast pipeline.loop_stall_s: each decoder layer says it moves.
        lm.on_layer = self.progressed
        return lm

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        if self._sleep_level:
            raise EngineError("engine is sleeping")
        rid = request.request_id
        if rid in self._ids:
            raise EngineError(f"request {rid!r} is already queued or running")
        prompt = self._prompt_of(request)
        p = request.effective_sampling()
        if not prompt:
            raise EngineError(f"request {rid!r}: the prompt is empty")
        if len(prompt) > self.max_model_len:
            raise EngineError(f"request {rid!r}: prompt has {len(prompt)} tokens, more than "
                              f"max_model_len {self.max_model_len}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        if p.max_tokens < 1:
            raise EngineError(f"request {rid!r}: max_tokens must be >= 1, got {p.max_tokens}")
        if p.temperature < 0:
            raise EngineError(f"request {rid!r}: temperature must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise EngineError(f"request {rid!r}: top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise EngineError(f"request {rid!r}: top_k must be >= 0, got {p.top_k}")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
            raise EngineError(f"request {rid!r}: logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
        seed = p.seed if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        self._waiting.append(_Seq(rid, prompt, p, torch.Generator().manual_seed(seed)))
        self._ids.add(rid)

    def _prompt_of(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return [int(t) for t in request.prompt_token_ids]
        if request.text is None:
            raise EngineError(f"request {request.request_id!r} has neither prompt_token_ids nor text")
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError) as exc:
                raise EngineError(f"text prompt given but {self.model_path} has no usable tokenizer: "
                                  f"{exc}") from exc
        return list(self._tokenizer.encode(request.text))

    def abort(self, request_id: str) -> None:
        if request_id not in self._ids:
            return
        self._ids.discard(request_id)
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                return
        for slot, seq in list(self._running.items()):
            if seq.request_id == request_id:
                del self._running[slot]
                return

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    # ---- the step ----------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        if self._sleep_level or not self.has_unfinished():
            return []
        t0 = time.perf_counter()
        decoding = sorted(self._running)               # running before this step
        outputs: list[EngineOutput] = []
        for slot in self._free_slots():
            if not self._waiting:
                break
            outputs.append(self._prefill(self._waiting.popleft(), slot))
        if decoding:
            outputs.extend(self._decode(decoding))
        self._steps += 1
        self._step_ms_last = (time.perf_counter() - t0) * 1e3
        self._step_ms_total += self._step_ms_last
        return outputs

    def _free_slots(self) -> list[int]:
        return [s for s in range(self.max_num_seqs) if s not in self._running]

    def _prefill(self, seq: _Seq, slot: int) -> EngineOutput:
        seq.slot = slot
        self._running[slot] = seq
        logits, hidden = self._lm.prefill(slot, seq.prompt)
        self._prompt_tokens += len(seq.prompt)
        token = sample(logits.unsqueeze(0), [seq.params], [seq.generator], [(seq.prompt, seq.output)],
                       self.eos_token_ids)[0]
        # sample() left `logits` raw (it shapes a copy): vLLM's default raw logprobs.
        lp = from_logits(logits.unsqueeze(0), [token], [seq.params.logprobs])[0]
        out = self._emit(seq, token, hidden)
        out.logprobs = lp
        out.num_prompt_tokens = len(seq.prompt)
        return out

    def _decode(self, slots: list[int]) -> list[EngineOutput]:
        seqs = [self._running[s] for s in slots]
        logits, hidden = self._lm.decode(slots, [s.output[-1] for s in seqs],
                                         [s.length - 1 for s in seqs])
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                        [(s.prompt, s.output) for s in seqs], self.eos_token_ids)
        lps = from_logits(logits, tokens, [s.params.logprobs for s in seqs])
        outs = [self._emit(seq, tok, hidden[i:i + 1]) for i, (seq, tok) in enumerate(zip(seqs, tokens))]
        for out, lp in zip(outs, lps):
            out.logprobs = lp
        return outs

    def _emit(self, seq: _Seq, token: int, hidden: torch.Tensor) -> EngineOutput:
        seq.output.append(token)
        self._gen_tokens += 1
        out = EngineOutput(request_id=seq.request_id, token_ids=[token])
        if self.emit_hidden_states:
            out.tensors = {"hidden_states": hidden.clone()}
        reason = self._finish_reason(seq, token)
        if reason is not None:
            out.finished = True
            out.finish_reason = reason
            if reason == "stop":
                out.stop_reason = token   # a stop_token_ids entry or an EOS id (the frontend nulls the tokenizer's EOS)
            del self._running[seq.slot]
            self._ids.discard(seq.request_id)
        return out

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output) >= p.max_tokens or seq.length >= self.max_model_len:
            return "length"
        return None

    # ---- sleep -------------------------------------------------------------------
    def can_sleep(self) -> bool:
        return True

    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished():
            raise EngineError(f"cannot sleep with {len(self._waiting) + len(self._running)} "
                              "unfinished requests; drain or abort them first")
        if self._sleep_level >= level:
            return
        if level == 2:
            self._lm = None                  # weights and cache go; wake_up reloads from disk
        elif self._lm is not None:
            self._lm.free_cache()
        self._sleep_level = level
        gc.collect()
        logger.info("engine asleep (level %d)", level)

    def wake_up(self) -> None:
        if not self._sleep_level:
            return
        if self._lm is None:
            self._lm = self._load()
        elif self._lm.k_cache is None:
            self._lm.alloc_cache()
        self._sleep_level = 0
        logger.info("engine awake")

    # ---- stats -------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "steps": float(self._steps),
            "prompt_tokens": float(self._prompt_tokens),
            "generation_tokens": float(self._gen_tokens),
            "num_running": float(len(self._running)),
            "num_waiting": float(len(self._waiting)),
            "step_ms_last": self._step_ms_last,
            "step_ms_avg": self._step_ms_total / self._steps if self._steps else 0.0,
            "sleep_level": float(self._sleep_level),
        }

    def shutdown(self) -> None:
        self._waiting.clear()
        self._running.clear()
        self._ids.clear()
        self._lm = None
        gc.collect()


def _eos_ids(model) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return frozenset(ids)
