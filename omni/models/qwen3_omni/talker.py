"""Qwen3-Omni talker + code predictor as an omni Engine (engine name `qwen3_talker`).

Request contract: one continuing request per thinker request, fed in pieces with the
same request_id; `final` (default True) marks the last piece.
  first piece   `prompt_token_ids` (or an int tensor `tensors["prompt_token_ids"]`) = the
                thinker's prompt ids (audio placeholders expanded, ending with the
                `<|im_start|>assistant\\n` header);
                `voice`: chelsie / ethan / aiden, any case (default ethan, as transformers);
                optional `tensors["mm_hidden"]` float [n_mm, H_thinker]: the thinker's
                layer-`accept_hidden_layer` rows at every audio/image/video placeholder
                of the prompt, in order (audio only: image/video need 3-D positions);
                `generated_ids`: the thinker's first generated ids (may be empty).
  later pieces  generated ids (delta) in `generated_ids`, or in `prompt_token_ids`
                (where the orchestrator puts a StageInput's `token_ids`), including the
                thinker's EOS if it stopped on it; ids after that EOS are ignored.
Sampling: `request.overrides` (the stage's defaults) over `request.sampling` (temperature
<= 0 is greedy; top_k, top_p, seed -> the request's own uniforms; max_tokens = the talker's max
new tokens, as transformers' `talker_max_new_tokens`: at most max_tokens - 1 frames);
repetition_penalty from the overrides, else the engine's (1.05); stop_token_ids only the codec's end;
min_tokens and ignore_eos from the overrides hold the codec's end back (talker_sampling.py).
Residual codes: greedy when code 0 is, else engine arg `subtalker_sampling_params` (vllm-omni's; default top_k 50, top_p 0.8).
Output: `tensors["codes"]` int64 [16, n] per chunk (first `first_chunk_frames`, then
`chunk_frames`); finished at codec EOS ("stop") or max_tokens ("length").

The talker prefills once it has the first generated id and then takes one trailing text row per step; a
request whose next id has not arrived (stream not final) skips the step while others go on. Sleep moves
the weights to host memory when idle; on CPU there is no device memory to free, so it refuses.

Decode paths: the static step (default; omni/models/qwen3_omni/slots.py, static_step.py: `max_num_seqs`
slots of `max_model_len` positions, CUDA graphs unless `enforce_eager`, MoE formulation `moe_impl`) or,
with `static_decode: false`, transformers' modules with a DynamicCache per request (the reference).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omni.config_checks import codec_stops
from omni.engines.base import EngineError, EngineOutput, EngineRequest, StreamEngine
from omni.engines.offload import IdleOffload
from omni.models.qwen3_omni import edges
from omni.models.qwen3_omni.codes import Pick, pick, repetition_penalty, residual_codes, residual_pick, suppress_mask
from omni.models.qwen3_omni.moe import probed_impl
from omni.models.qwen3_omni.sampling import Uniforms
from omni.models.qwen3_omni.slots import SlotRunner, static_runner
from omni.models.qwen3_omni.talker_sampling import TalkerSampling, end_mask, hold_ends, talker_sampling
from omni.models.qwen3_omni.weights import load_talker

logger = logging.getLogger(__name__)

DEFAULT_SPEAKER = "ethan"     # transformers' generate() default

_IN_BATCH = object()      # a request's cache while its rows live in the batch cache


@dataclasses.dataclass
class _Batch:
    reqs: tuple["TalkerRequest", ...]
    cache: Any                # DynamicCache [B, kv_heads, width, head_dim] per layer, left-padded
    lengths: list[int]        # real positions per row
    width: int


@dataclasses.dataclass
class TalkerRequest:
    rid: str
    prompt: list[int]
    speaker_id: int
    mm_hidden: torch.Tensor | None
    code0: Pick
    uniforms: Uniforms | None          # the request's random stream (None: greedy)
    penalty: float
    max_tokens: int
    min_tokens: int = 0               # no codec end before this many codes (talker_sampling.py)
    generated: list[int] = dataclasses.field(default_factory=list)
    text: tuple[list[int], bool] | None = None   # (trailing ids, thinker EOS seen), cached
    final: bool = False
    cache: Any = None                 # DynamicCache after prefill
    step: int = 0                     # decode steps done (= trailing rows consumed)
    history: list[int] = dataclasses.field(default_factory=list)   # code-0 ids chosen
    next_codec: torch.Tensor | None = None   # codec part of the next input [H]
    frames: list[torch.Tensor] = dataclasses.field(default_factory=list)   # unsent [16] frames
    sent: int = 0
    first_out: bool = True
    done: str | None = None           # finish reason once finished
    error: str | None = None
    slot: int | None = None           # static step: the request's slot, and its next position there
    pos: int = 0


class Qwen3TalkerEngine(StreamEngine):
    name = "qwen3_talker"
    default_speaker = DEFAULT_SPEAKER
    prefill_extra = 6     # prefill rows past the prompt's (edges.prefill_embeds: 9 for its 3-token header)

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 first_chunk_frames: int = 4, chunk_frames: int = 25, repetition_penalty: float = 1.05,
                 text_eos_token_ids: list[int] | None = None, batch_decode: bool = True,
                 threads: int | None = None, max_num_seqs: int = 64, static_decode: bool = True,
                 enforce_eager: bool = False, max_model_len: int = 4096, moe_impl: str | None = None,
                 parts: tuple | None = None, subtalker_sampling_params: dict | None = None):
        self._init_common(device, first_chunk_frames, chunk_frames, repetition_penalty, batch_decode, max_num_seqs,
                          static_decode, threads)
        self.residual = residual_pick(subtalker_sampling_params)     # the code predictor's sampling (codes.py)
        # parts: (config, talker module, thinker embedding table) built in memory (benchmarks at real
        # size); model_dir is then unused
        self.config, self.talker, self.embed = parts or load_talker(model_dir, dtype=dtype, device=device)
        self.ids = edges.TalkerIds.from_config(self.config)
        self.text_eos = set(text_eos_token_ids or [self.config.im_end_token_id])
        self.codec_stops = codec_stops(self.name, self.config.talker_config)   # its ends, also a request's stop_token_ids
        self._suppress = suppress_mask(self.config.talker_config.text_config.vocab_size, self.ids.codec_eos, self.device)
        self._ends = end_mask(self._suppress.shape[0], self.codec_stops, self.device)
        with torch.no_grad():
            self._tts = edges.tts_rows(self.talker, self.embed, self.ids)
            if static_decode and moe_impl is None:      # chosen once: a wake-up's rebuild keeps it
                moe_impl = probed_impl(self.talker.model.layers[0].mlp, self.device, self.embed.dtype)
        self._init_static((max_num_seqs, max_model_len, moe_impl, enforce_eager) if static_decode else None)

    def _init_common(self, device: str, first_chunk_frames: int, chunk_frames: int, repetition_penalty: float,
                     batch_decode: bool, max_num_seqs: int, static_decode: bool, threads: int | None) -> None:
        """The engine args both talkers take, checked, and the empty request table."""
        if first_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError(f"first_chunk_frames and chunk_frames must be >= 1, "
                             f"got {first_chunk_frames} and {chunk_frames}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if static_decode and not batch_decode:
            raise ValueError("batch_decode: false needs static_decode: false (the static step always batches)")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.repetition_penalty = repetition_penalty
        self.batch_decode = batch_decode
        self.max_num_seqs = max_num_seqs     # requests decoded in one step; the rest wait their turn
        self._reqs: collections.OrderedDict[str, TalkerRequest] = collections.OrderedDict()
        self._stats: collections.Counter = collections.Counter()
        self._batch: _Batch | None = None

    def _init_static(self, static_args: tuple | None) -> None:
        """The static step (None: the eager path), once the weights are loaded, and sleep's offload."""
        self._static_args = static_args
        self.max_prompt_len = None if static_args is None else static_args[1] - 1 - self.prefill_extra  # replica_limits
        self._static: SlotRunner | None = self._build_static()
        self.offload = IdleOffload(self.name, self.device, off=self._to_host, on=self._to_device)

    def _build_static(self) -> SlotRunner | None:
        """The static step's device state and graphs (None: the eager path)."""
        return None if self._static_args is None else static_runner(self, *self._static_args)

    def _cache_config(self):
        """The config a talker KV cache is built from (the Qwen2.5 talker overrides it)."""
        return self.talker.config.text_config

    # -- requests ------------------------------------------------------------

    def _speakers(self) -> dict[str, int]:
        """Speaker name (lower case) -> the id the talker's prompt starts from."""
        return self.ids.speakers

    def _first_piece(self, req: EngineRequest) -> tuple[list[int], str]:
        """A new request's thinker prompt ids and its speaker (lower case), checked."""
        rid = req.request_id
        prompt = req.prompt_token_ids
        if prompt is None and "prompt_token_ids" in (req.tensors or {}):
            prompt = torch.as_tensor(req.tensors["prompt_token_ids"]).reshape(-1).tolist()
        if not prompt:
            raise EngineError(f"request {rid}: the first piece needs prompt_token_ids (the thinker's prompt)")
        name = req.voice or self.default_speaker
        if not isinstance(name, str) or name.lower() not in self._speakers():
            raise EngineError(f"request {rid}: unknown speaker {name!r}; known speakers: "
                              f"{', '.join(sorted(self._speakers()))}")
        return self._ids(rid, prompt), name.lower()

    def _new(self, req: EngineRequest) -> TalkerRequest:
        rid = req.request_id
        prompt, name = self._first_piece(req)
        try:
            header = len(prompt) - edges.assistant_start(prompt, self.ids)
        except ValueError as e:
            raise EngineError(f"request {rid}: {e}") from None
        if header != 3:
            raise EngineError(f"request {rid}: the prompt must end with the 3-token assistant header "
                              f"('<|im_start|>assistant\\n'), found {header} token(s) from it")
        mm = edges.mm_positions(prompt, self.ids)
        th = self.config.thinker_config
        if any(prompt[p] in (th.image_token_id, th.video_token_id) for p in mm):
            raise EngineError(f"request {rid}: image/video prompts need 3-D talker positions (not supported)")
        hidden = (req.tensors or {}).get("mm_hidden")
        if hidden is not None:
            hidden = torch.as_tensor(hidden)
            if hidden.ndim != 2 or hidden.shape[1] != self.embed.shape[1] or not hidden.is_floating_point():
                raise EngineError(f"request {rid}: mm_hidden must be float [n, {self.embed.shape[1]}], "
                                  f"got {hidden.dtype} {list(hidden.shape)}")
            hidden = hidden.to(self.device, self.embed.dtype, non_blocking=True)
        if len(mm) != (0 if hidden is None else hidden.shape[0]):
            raise EngineError(f"request {rid}: the prompt has {len(mm)} audio placeholder(s) but "
                              f"mm_hidden has {0 if hidden is None else hidden.shape[0]} row(s)")
        s = self._sampling(req)
        code0 = Pick(s.temperature, s.top_k, s.top_p)
        uniforms = None if code0.greedy else Uniforms(s.seed, self.config.talker_config.num_code_groups)
        return TalkerRequest(rid, prompt, self.ids.speakers[name], hidden, code0, uniforms, s.penalty,
                             s.max_tokens, s.min_tokens)

    def _sampling(self, req: EngineRequest) -> TalkerSampling:
        """The talker's sampling (the stage's own over the request's), checked (talker_sampling.py)."""
        return talker_sampling(self.name, req, self.repetition_penalty, self.codec_stops)

    def _ids(self, rid: str, ids) -> list[int]:
        try:
            out = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise EngineError(f"request {rid}: token ids must be a list of ints") from None
        vocab = self.embed.shape[0]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"request {rid}: token ids {bad[:5]} are outside the thinker's vocabulary [0, {vocab})")
        return out

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self.offload.sleeping:
            raise EngineError(f"request {rid}: {self.name} is asleep (wake_up first)")
        final = request.final
        r = self._reqs.get(rid)
        delta = request.generated_ids
        if r is None:
            r = self._new(request)
        else:
            if r.final:
                raise EngineError(f"request {rid}: a piece after the one marked final")
            if delta is None:
                delta = request.prompt_token_ids
        r.generated.extend(self._ids(rid, delta or []))
        r.text = None
        r.final = final
        self._reqs[rid] = r

    def abort(self, request_id: str) -> None:
        r = self._reqs.pop(request_id, None)
        if r is not None and self._static is not None:
            self._static.release(r)

    # -- stepping --------------------------------------------------------------

    def _text(self, r: TalkerRequest) -> tuple[list[int], bool]:
        if r.text is None:       # recomputed only after a new piece
            r.text = edges.trailing_ids(r.generated, self.text_eos)
        trailing, ended = r.text
        return trailing, ended or r.final

    def _next_text_row(self, r: TalkerRequest) -> torch.Tensor | None:
        """The trailing text row for decode step `r.step`, or None while it has not arrived."""
        trailing, closed = self._text(r)
        if r.step < len(trailing):
            return edges.text_rows(self.talker, self.embed, [trailing[r.step]])[0]
        if not closed:
            return None
        return self._tts[1] if r.step == len(trailing) else self._tts[2]

    def _can_prefill(self, r: TalkerRequest) -> bool:
        return (r.cache is None and r.done is None and bool(r.generated)
                and (self._static is None or self._static.free() > 0))

    def _can_decode(self, r: TalkerRequest) -> bool:
        if r.cache is None or r.done is not None or r.next_codec is None:
            return False
        trailing, closed = self._text(r)
        return closed or r.step < len(trailing)

    def _ready(self, r: TalkerRequest) -> bool:
        if r.done is not None:
            return True
        if r.cache is None and r.final and not r.generated:
            return True       # the thinker said nothing: no audio
        return self._can_prefill(r) or self._can_decode(r)

    def _settle(self, r: TalkerRequest) -> None:
        """End a request that will never need a prefill (the thinker said nothing)."""
        if r.done is None and r.cache is None and r.final and not r.generated:
            r.done = "stop"

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """A decode step's input rows [B, H] as the talker's layers take them."""
        return x

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if self._static is not None:
            return self._static.engine_step()
        t0 = time.perf_counter()
        chosen: list[TalkerRequest] = []
        hidden: list[torch.Tensor] = []
        decode = []
        for r in list(self._reqs.values()):
            self._settle(r)
            if self._can_prefill(r):
                h = self._prefill(r)
                if h is not None:
                    chosen.append(r)
                    hidden.append(h)
            elif self._can_decode(r) and len(decode) < self.max_num_seqs:
                decode.append(r)
        for r in decode:            # round-robin when more can step than one batch takes
            self._reqs.move_to_end(r.rid)
        if decode:
            x = self._project(torch.stack([r.next_codec + self._next_text_row(r) for r in decode]))
            h = self._decode(decode, x) if self.batch_decode else torch.cat(
                [self._decode([r], x[i:i + 1]) for i, r in enumerate(decode)])
            for r in decode:
                r.step += 1
            chosen.extend(decode)
            hidden.extend(h)
        if chosen:
            logits = list(self.talker.codec_head(torch.stack(hidden)).float())
            self._sample(chosen, logits, hidden)
            self._stats["talker_seconds"] += time.perf_counter() - t0
            self._stats["talker_steps"] += 1
        return self._emit()

    def _prefill_embeds(self, r: TalkerRequest) -> torch.Tensor:
        """The request's prefill rows [n, H] (ValueError: its inputs do not fit)."""
        return edges.prefill_embeds(self.talker, self.embed, self.ids, r.prompt, r.generated[0],
                                    r.speaker_id, r.mm_hidden, self._tts)

    def _prefill(self, r: TalkerRequest) -> torch.Tensor | None:
        from transformers import DynamicCache

        try:
            x = self._prefill_embeds(r)
        except ValueError as e:
            r.done, r.frames, r.error = "error", [], f"request {r.rid}: {e}"
            return None
        r.cache = DynamicCache(config=self._cache_config())
        self._stats["prefill_tokens"] += x.shape[0]
        try:
            return self.talker.model(inputs_embeds=x[None], past_key_values=r.cache,
                                     use_cache=True).last_hidden_state[0, -1]
        except torch.OutOfMemoryError:   # this request's prefill is too large here (as the static path's)
            r.cache, r.done, r.frames = None, "error", []
            r.error = f"request {r.rid}: out of device memory in the talker prefill ({x.shape[0]} rows)"
            if x.is_cuda:
                torch.cuda.empty_cache()
            return None

    def _decode(self, reqs: list[TalkerRequest], x: torch.Tensor) -> torch.Tensor:
        """One talker forward for one new row per request (x [B, H]) -> last normed hidden [B, H].

        Several requests decode in one batch cache: their caches left-padded and masked. The
        batch stays while the same requests step together (the usual case: only a new,
        finished or waiting request changes it), so the caches are copied only then."""
        if len(reqs) == 1:
            self._unbatch()
            return self.talker.model(inputs_embeds=x[:, None], past_key_values=reqs[0].cache,
                                     use_cache=True).last_hidden_state[:, -1]
        if self._batch is None or len(self._batch.reqs) != len(reqs) or any(
                a is not b for a, b in zip(self._batch.reqs, reqs)):   # identity: ids may be reused
            self._unbatch()
            self._batch = self._make_batch(reqs)
        b = self._batch
        mask = torch.zeros((len(reqs), b.width + 1), dtype=torch.long, device=self.device)
        for row, n in enumerate(b.lengths):
            mask[row, b.width - n:] = 1
        pos = torch.tensor(b.lengths, device=self.device).view(1, -1, 1).expand(3, -1, -1)
        h = self.talker.model(inputs_embeds=x[:, None], past_key_values=b.cache, attention_mask=mask,
                              position_ids=pos, use_cache=True).last_hidden_state[:, -1]
        b.width += 1
        b.lengths = [n + 1 for n in b.lengths]
        self._stats["batched_decodes"] += 1
        return h

    def _make_batch(self, reqs: list[TalkerRequest]) -> "_Batch":
        from transformers import DynamicCache

        lengths = [r.cache.get_seq_length() for r in reqs]
        width = max(lengths)
        cache = DynamicCache(config=self._cache_config())
        for i in range(len(reqs[0].cache.layers)):
            pad = [(0, 0, width - n, 0) for n in lengths]
            cache.update(
                torch.cat([F.pad(r.cache.layers[i].keys, p) for r, p in zip(reqs, pad)]),
                torch.cat([F.pad(r.cache.layers[i].values, p) for r, p in zip(reqs, pad)]), i)
        for r in reqs:
            r.cache = _IN_BATCH
        self._stats["batch_builds"] += 1
        return _Batch(tuple(reqs), cache, lengths, width)

    def _unbatch(self) -> None:
        """Give each live request of the batch its own cache back (its rows without the padding)."""
        from transformers import DynamicCache

        b, self._batch = self._batch, None
        if b is None:
            return
        for row, r in enumerate(b.reqs):
            if self._reqs.get(r.rid) is not r or r.done is not None:
                continue
            cache = DynamicCache(config=self._cache_config())
            start = b.width - b.lengths[row]
            for i, layer in enumerate(b.cache.layers):
                cache.update(layer.keys[row:row + 1, :, start:], layer.values[row:row + 1, :, start:], i)
            r.cache = cache

    def _sample(self, chosen: list[TalkerRequest], logits: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        go, go_hidden = [], []
        for r, row, h in zip(chosen, logits, hidden):
            row = repetition_penalty(row, r.history, r.penalty)
            row = hold_ends(row.masked_fill(self._suppress, float("-inf")), len(r.history), r.min_tokens, self._ends)
            code = pick(row, r.code0, None if r.uniforms is None else r.uniforms.rows(len(r.history) + 1)[-1, 0])
            r.history.append(code)
            if code in self.codec_stops:
                r.done = "stop"
            elif len(r.history) >= r.max_tokens:
                r.done = "length"     # as transformers: the last code 0 gets no residual codes
            else:
                go.append(r)
                go_hidden.append(h)
        if not go:
            return
        code0 = torch.tensor([r.history[-1] for r in go], dtype=torch.long, device=self.device)
        greedy = torch.tensor([r.uniforms is None for r in go], device=self.device)
        u = None if all(r.uniforms is None for r in go) else torch.stack(
            [torch.zeros(self.config.talker_config.num_code_groups) if r.uniforms is None
             else r.uniforms.rows(len(r.history))[-1] for r in go]).to(self.device)
        codes, codec = residual_codes(self.talker, torch.stack(go_hidden), code0, greedy, u, self.residual)
        self._stats["frames"] += len(go)
        for i, r in enumerate(go):
            r.frames.append(codes[i])
            r.next_codec = codec[i]

    def code_groups(self) -> int:
        """Codes per frame (a `codes` chunk is [groups, n]); the Qwen2.5 talker has one codebook."""
        return self.config.talker_config.num_code_groups

    def _emit(self) -> list[EngineOutput]:
        outs = []
        for r in list(self._reqs.values()):
            want = self.first_chunk_frames if r.sent == 0 else self.chunk_frames
            if r.done is None and len(r.frames) < want:
                continue
            if r.done is None:
                frames, r.frames = r.frames[:want], r.frames[want:]
            else:
                frames, r.frames = r.frames, []
                del self._reqs[r.rid]
            codes = torch.stack(frames, dim=1) if frames else torch.zeros((self.code_groups(), 0), dtype=torch.long)
            r.sent += len(frames)
            out = EngineOutput(request_id=r.rid, tensors={} if r.error else {"codes": codes.cpu().contiguous()},
                               finished=r.done is not None, finish_reason=r.done, error=r.error,
                               num_prompt_tokens=len(r.prompt) if r.first_out else None)
            r.first_out = False
            outs.append(out)
        return outs

    # -- bookkeeping -------------------------------------------------------------

    def open_requests(self):
        return self._reqs.values()

    def is_ready(self, r: TalkerRequest) -> bool:
        return self._ready(r)

    # -- sleep: the weights and the static step's state leave the device ---------------

    def _to_host(self) -> None:
        # The static state (slot KV cache, stacked weight copies, CUDA graphs holding their
        # addresses) is dropped, not moved: wake-up builds it again, so graphs see live addresses.
        self._static, self._batch = None, None
        self.talker.to("cpu")
        self.embed = self.embed.cpu()

    def _to_device(self) -> None:
        self.talker.to(self.device)
        self.embed = self.embed.to(self.device)
        self._static = self._build_static()

    def can_sleep(self) -> bool:
        return self.offload.can_sleep()

    def sleep(self, level: int = 1) -> None:
        self.offload.sleep(len(self._reqs), "request(s) in flight")

    def wake_up(self) -> None:
        self.offload.wake_up()

    def is_sleeping(self) -> bool:
        return self.offload.sleeping

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
