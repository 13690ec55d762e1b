"""Qwen2.5-Omni talker as an omni Engine (engine name `qwen25_talker`): one codebook, 50 Hz.

Request contract (the Qwen3 talker's, plus the thinker's rows): one continuing request per
thinker request, fed in pieces with the same request_id; `final` (default True)
marks the last piece.
  first piece   `prompt_token_ids` (or an int tensor `tensors["prompt_token_ids"]`) = the
                thinker's prompt ids (audio placeholders expanded);
                `voice`: chelsie / ethan, any case (default chelsie, as transformers);
                `generated_ids`: the thinker's first generated ids.
  every piece   `tensors["thinker_hidden"]` float [n, H_thinker]: the thinker's final-normed
                last-layer rows (what its lm_head reads), appended in order: one per prompt
                position, then one per generated id the thinker has fed (a generated id's row
                comes with the next id). Text-only input needs them too: the talker reads
                embed(id) + row at every position. Or `tensors["thinker_last_layer"]`: the
                same rows before the final norm (the last layer's residual output), which
                the talker normalises with the thinker's norm weights.
  later pieces  generated ids (delta) in `generated_ids` or `prompt_token_ids`, including
                the thinker's EOS if it stopped on it; ids after that EOS are ignored.
Sampling: `request.overrides` over `request.sampling` as the Qwen3 talker (temperature <= 0 greedy; top_k,
top_p, seed -> the request's own uniforms; max_tokens = transformers' talker_max_new_tokens);
repetition penalty 1.05 over the codec prompt ids and the codes so far; codec bos suppressed;
codec eos or pad ends the utterance. Output `tensors["codes"]` int64 [1, n] per chunk.
`codec_rows`: add the codec pad / bos embeddings to the last two prefill rows as the original
Qwen code does; off by default because transformers 5.19's generate() (the reference) skips them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from omni.engines.base import EngineError, EngineOutput, EngineRequest
from omni.models.qwen25_omni import edges
from omni.models.qwen25_omni.weights import load_speakers, load_talker
from omni.models.qwen3_omni.codes import Pick, pick, repetition_penalty
from omni.models.qwen3_omni.sampling import Uniforms
from omni.models.qwen25_omni.static_step import TEXT, TTS_EOS, TTS_PAD, static_runner25
from omni.models.qwen3_omni.talker import Qwen3TalkerEngine, TalkerRequest

DEFAULT_SPEAKER = "chelsie"     # transformers' generate() default


@dataclasses.dataclass
class _Req25(TalkerRequest):
    rows: list[torch.Tensor] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    speaker_bos: int = 0
    rows_in_slot: int = 0         # static step: rows copied into the request's slot so far


class Qwen25TalkerEngine(Qwen3TalkerEngine):
    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 first_chunk_frames: int = 25, chunk_frames: int = 50, repetition_penalty: float = 1.05,
                 text_eos_token_ids: list[int] | None = None, batch_decode: bool = True,
                 codec_rows: bool = False, threads: int | None = None, parts: tuple | None = None,
                 static_decode: bool = True, enforce_eager: bool = False, max_model_len: int = 4096,
                 max_num_seqs: int = 16):
        import collections

        if first_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError(f"first_chunk_frames and chunk_frames must be >= 1, "
                             f"got {first_chunk_frames} and {chunk_frames}")
        if threads:
            torch.set_num_threads(threads)
        if parts is not None:     # (config, talker, embed table, thinker norm, {voice: bos id}) built in memory
            self.config, self.talker, self.embed, self.norm, self.speakers = parts
        else:
            self.config, self.talker, self.embed, self.norm = load_talker(model_dir, dtype=dtype, device=device)
            self.speakers = {k.lower(): int(v["bos_token"]) for k, v in load_speakers(model_dir).items()}
        self.ids = edges.TalkerIds.from_config(self.config)
        self.device = torch.device(device)
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.repetition_penalty = repetition_penalty
        self.batch_decode = batch_decode
        self.codec_rows = codec_rows
        self.text_eos = set(text_eos_token_ids or [self.config.thinker_config.text_config.eos_token_id])
        self.stop_codes = {self.ids.codec_eos, self.ids.codec_pad}
        self._suppress = torch.zeros(self.talker.codebook_size, dtype=torch.bool, device=self.device)
        self._suppress[self.ids.codec_bos] = True
        with torch.no_grad():
            rows = self.embed[[self.ids.tts_eos, self.ids.tts_pad]]
        self._tts = (None, rows[0], rows[1])
        self._reqs = collections.OrderedDict()
        self._stats = collections.Counter()
        self._sleeping = False
        self._batch = None
        self._static = None
        if static_decode:
            if not batch_decode:
                raise ValueError("batch_decode: false needs static_decode: false (the static step always batches)")
            self._static = static_runner25(self, max_num_seqs, max_model_len, enforce_eager)

    def _cache_config(self):
        return self.talker.config

    # -- requests ------------------------------------------------------------

    def _hidden(self, req: EngineRequest) -> torch.Tensor | None:
        tensors = req.tensors or {}
        keys = [k for k in ("thinker_hidden", "thinker_last_layer") if k in tensors]
        if not keys:
            return None
        if len(keys) > 1:
            raise EngineError(f"request {req.request_id}: send thinker_hidden or thinker_last_layer, not both")
        t = torch.as_tensor(tensors[keys[0]])
        if t.ndim != 2 or t.shape[1] != self.embed.shape[1] or not t.is_floating_point():
            raise EngineError(f"request {req.request_id}: {keys[0]} must be float [n, {self.embed.shape[1]}], "
                              f"got {t.dtype} {list(t.shape)}")
        t = t.to(self.device, self.embed.dtype)
        if keys[0] == "thinker_last_layer":
            with torch.no_grad():
                t = self.norm(t)
        return t

    def _new(self, req: EngineRequest) -> _Req25:
        rid = req.request_id
        prompt = req.prompt_token_ids
        if prompt is None and "prompt_token_ids" in (req.tensors or {}):
            prompt = torch.as_tensor(req.tensors["prompt_token_ids"]).reshape(-1).tolist()
        if not prompt:
            raise EngineError(f"request {rid}: the first piece needs prompt_token_ids (the thinker's prompt)")
        name = req.voice or DEFAULT_SPEAKER
        if not isinstance(name, str) or name.lower() not in self.speakers:
            raise EngineError(f"request {rid}: unknown speaker {name!r}; known speakers: "
                              f"{', '.join(sorted(self.speakers))}")
        prompt = self._ids(rid, prompt)
        th = self.config.thinker_config
        if any(t in (th.image_token_index, th.video_token_index) for t in prompt):
            raise EngineError(f"request {rid}: image/video prompts need 3-D talker positions (not supported)")
        temperature, top_k, top_p, max_tokens, penalty, seed = self._sampling(req, rid)
        code0 = Pick(temperature, top_k, top_p)
        r = _Req25(rid, prompt, 0, None, code0, None if code0.greedy else Uniforms(seed, 1), penalty, max_tokens)
        r.speaker_bos = self.speakers[name.lower()]
        # transformers' repetition penalty also sees the talker's prompt ids (mask x n, pad, bos)
        r.history = [self.ids.codec_mask, self.ids.codec_pad, self.ids.codec_bos]
        return r

    def add_request(self, request: EngineRequest) -> None:
        rows = self._hidden(request)
        super().add_request(request)
        if rows is not None and rows.shape[0]:
            r = self._reqs[request.request_id]
            r.rows.append(rows)
            r.n_rows += rows.shape[0]
            if r.slot is not None:        # static step: the slot holds the request's rows on the device
                self._static.dev.put_rows(r.slot, r.rows_in_slot, rows)
                r.rows_in_slot = r.n_rows

    # -- stepping --------------------------------------------------------------

    def _gen(self, r: _Req25) -> tuple[list[int], int | None]:
        """(generated ids cut after the thinker's first EOS, reply index p or None while open)."""
        if r.text is None:
            gen = r.generated
            for i, tok in enumerate(gen):
                if tok in self.text_eos:
                    gen = gen[:i + 1]
                    break
            r.text = (gen, edges.reply_index(gen, self.text_eos, r.final))
        return r.text

    def _rows(self, r: _Req25) -> torch.Tensor:
        if len(r.rows) > 1:
            r.rows = [torch.cat(r.rows)]
        return r.rows[0]

    def _next_text(self, r: _Req25) -> tuple[int, int, int] | None:
        """What reply(j) for the next decode step j = step + 1 reads: (TEXT, row index, thinker id), or
        (TTS_EOS / TTS_PAD, 0, 0); None while it has not arrived."""
        gen, p = self._gen(r)
        j, n = r.step + 1, len(r.prompt)
        if j < (len(gen) - 1 if p is None else p):     # the thinker's text: its id and its row
            return (TEXT, n + j, gen[j]) if r.n_rows > n + j else None
        if p is None:
            return None       # j is the newest id: text or the end, unknown until more arrives
        return (TTS_EOS, 0, 0) if j == p else (TTS_PAD, 0, 0)

    def _next_text_row(self, r: _Req25) -> torch.Tensor | None:
        """reply(j) for the next decode step j = step + 1, or None while it has not arrived."""
        got = self._next_text(r)
        if got is None:
            return None
        kind, at, token = got
        return self._rows(r)[at] + self.embed[token] if kind == TEXT else self._tts[kind]

    def _no_audio(self, r: _Req25) -> bool:
        gen, p = self._gen(r)
        return r.cache is None and p is not None and len(gen) < 2

    def _prefill_ready(self, r: _Req25) -> bool:
        """The first two generated ids and the rows up to the first are here."""
        return len(self._gen(r)[0]) >= 2 and r.n_rows > len(r.prompt)

    def _can_prefill(self, r: _Req25) -> bool:
        return (r.cache is None and r.done is None and not self._no_audio(r) and self._prefill_ready(r)
                and (self._static is None or self._static.free() > 0))

    def _can_decode(self, r: _Req25) -> bool:
        return (r.cache is not None and r.done is None and r.next_codec is not None
                and self._next_text(r) is not None)

    def _ready(self, r: _Req25) -> bool:
        if r.done is not None or self._no_audio(r):
            return True
        if r.final and r.cache is None and not self._prefill_ready(r):
            return True       # will end with an error: the rows never came
        return self._can_prefill(r) or self._can_decode(r)

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        import time

        if self._static is not None:
            return self._static.engine_step()
        t0 = time.perf_counter()
        chosen, hidden, decode = [], [], []
        for r in list(self._reqs.values()):
            if r.done is None and self._no_audio(r):
                r.done = "stop"
            elif self._can_prefill(r):
                h = self._prefill(r)
                if h is not None:
                    chosen.append(r)
                    hidden.append(h)
            elif self._can_decode(r):
                decode.append(r)
            elif r.done is None and r.final and r.cache is None:
                r.done, r.error = "error", (f"request {r.rid}: the thinker's stream ended with {r.n_rows} "
                                            f"thinker_hidden row(s); the prefill needs {len(r.prompt) + 1}")
        if decode:
            x = self.talker.thinker_to_talker_proj(
                torch.stack([r.next_codec + self._next_text_row(r) for r in decode]))
            h = self._decode(decode, x) if self.batch_decode else torch.cat(
                [self._decode([r], x[i:i + 1]) for i, r in enumerate(decode)])
            for r in decode:
                r.step += 1
            chosen.extend(decode)
            hidden.extend(h)
        if chosen:
            logits = self.talker.codec_head(torch.stack(hidden)).float()
            self._sample(chosen, list(logits))
            self._stats["talker_seconds"] += time.perf_counter() - t0
            self._stats["talker_steps"] += 1
        return self._emit()

    def _prefill(self, r: _Req25) -> torch.Tensor | None:
        from transformers import DynamicCache

        gen, _ = self._gen(r)
        try:
            x = edges.prefill_rows(self.talker, self.embed, self.ids, r.prompt, gen[0], r.speaker_bos,
                                   self._rows(r)[:len(r.prompt) + 1], self.codec_rows)
        except ValueError as e:
            r.done, r.frames, r.error = "error", [], f"request {r.rid}: {e}"
            return None
        r.cache = DynamicCache(config=self._cache_config())
        self._stats["prefill_tokens"] += x.shape[0]
        return self.talker.model(inputs_embeds=x[None], past_key_values=r.cache,
                                 use_cache=True).last_hidden_state[0, -1]

    def _sample(self, chosen: list[_Req25], logits: list[torch.Tensor]) -> None:
        emb = self.talker.get_input_embeddings()
        for r, row in zip(chosen, logits):
            row = repetition_penalty(row, r.history, r.penalty)
            row = row.masked_fill(self._suppress, float("-inf"))
            frame = len(r.history) - 3      # the 3 prompt codes first
            code = pick(row, r.code0, None if r.uniforms is None else r.uniforms.rows(frame + 1)[-1, 0])
            r.history.append(code)
            if code in self.stop_codes:
                r.done = "stop"
                continue
            r.frames.append(torch.tensor([code], dtype=torch.long))
            self._stats["frames"] += 1
            if len(r.history) - 3 >= r.max_tokens:
                r.done = "length"
            else:
                r.next_codec = emb(torch.tensor(code, device=self.device))

    def code_groups(self) -> int:
        return 1
