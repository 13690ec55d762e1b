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
top_p, seed -> the request's own uniforms; max_tokens = transformers' talker_max_new_tokens; min_tokens, ignore_eos);
repetition penalty 1.05 over the codec prompt ids and the codes so far; codec bos suppressed;
codec eos or pad ends the utterance. Output `tensors["codes"]` int64 [1, n] per chunk.
`codec_rows`: add the codec pad / bos embeddings to the last two prefill rows as the original
Qwen code does; off by default because transformers 5.19's generate() (the reference) skips them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from omni.config_checks import codec_stops
from omni.engines.base import EngineError, EngineRequest
from omni.models.qwen25_omni import edges
from omni.models.qwen25_omni.weights import load_speakers, load_talker
from omni.models.qwen3_omni.codes import Pick, pick, repetition_penalty
from omni.models.qwen3_omni.sampling import Uniforms
from omni.models.qwen25_omni.static_step import TEXT, TTS_EOS, TTS_PAD, static_runner25
from omni.models.qwen3_omni.talker import Qwen3TalkerEngine, TalkerRequest
from omni.models.qwen3_omni.talker_sampling import end_mask, hold_ends

DEFAULT_SPEAKER = "chelsie"     # transformers' generate() default


@dataclasses.dataclass
class _Req25(TalkerRequest):
    rows: list[torch.Tensor] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    speaker_bos: int = 0
    rows_in_slot: int = 0         # static step: rows copied into the request's slot so far


class Qwen25TalkerEngine(Qwen3TalkerEngine):
    """The Qwen3 talker's request handling and steps over Qwen2.5's dense talker: one codebook (no
    code predictor), the thinker's rows projected per step, its own prefill and end rules."""

    name = "qwen25_talker"
    default_speaker = DEFAULT_SPEAKER
    prefill_extra = 2     # prefill rows past the prompt's: the speaker's bos and the first token (edges.prefill_rows)

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 first_chunk_frames: int = 25, chunk_frames: int = 50, repetition_penalty: float = 1.05,
                 text_eos_token_ids: list[int] | None = None, batch_decode: bool = True,
                 codec_rows: bool = False, threads: int | None = None, parts: tuple | None = None,
                 static_decode: bool = True, enforce_eager: bool = False, max_model_len: int = 4096,
                 max_num_seqs: int = 16):
        self._init_common(device, first_chunk_frames, chunk_frames, repetition_penalty, batch_decode, max_num_seqs,
                          static_decode, threads)
        if parts is not None:     # (config, talker, embed table, thinker norm, {voice: bos id}) built in memory
            self.config, self.talker, self.embed, self.norm, self.speakers = parts
        else:
            self.config, self.talker, self.embed, self.norm = load_talker(model_dir, dtype=dtype, device=device)
            self.speakers = {k.lower(): int(v["bos_token"]) for k, v in load_speakers(model_dir).items()}
        self.ids = edges.TalkerIds.from_config(self.config)
        self.codec_rows = codec_rows
        self.text_eos = set(text_eos_token_ids or [self.config.thinker_config.text_config.eos_token_id])
        self.stop_codes = self.codec_stops = codec_stops(self.name, self.config.talker_config)
        self._suppress = torch.zeros(self.talker.codebook_size, dtype=torch.bool, device=self.device)
        self._suppress[self.ids.codec_bos] = True
        self._ends = end_mask(self.talker.codebook_size, self.codec_stops, self.device)
        with torch.no_grad():
            rows = self.embed[[self.ids.tts_eos, self.ids.tts_pad]]
        self._tts = (None, rows[0], rows[1])
        self._init_static((max_num_seqs, max_model_len, enforce_eager) if static_decode else None)

    def _build_static(self):
        return None if self._static_args is None else static_runner25(self, *self._static_args)

    def _to_host(self) -> None:
        super()._to_host()
        self.norm.to("cpu")

    def _to_device(self) -> None:
        self.norm.to(self.device)
        super()._to_device()

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

    def _speakers(self) -> dict[str, int]:
        return self.speakers

    def _new(self, req: EngineRequest) -> _Req25:
        rid = req.request_id
        prompt, name = self._first_piece(req)
        th = self.config.thinker_config
        if any(t in (th.image_token_index, th.video_token_index) for t in prompt):
            raise EngineError(f"request {rid}: image/video prompts need 3-D talker positions (not supported)")
        s = self._sampling(req)
        code0 = Pick(s.temperature, s.top_k, s.top_p)
        r = _Req25(rid, prompt, 0, None, code0, None if code0.greedy else Uniforms(s.seed, 1), s.penalty,
                   s.max_tokens, s.min_tokens)
        r.speaker_bos = self.speakers[name]
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

    def _starved(self, r: _Req25) -> int | None:
        """The thinker_hidden rows a request needs that its ended stream never brought (None: not starved)."""
        if not r.final:
            return None
        if r.cache is None:
            return None if self._prefill_ready(r) else len(r.prompt) + 1
        # after the final piece None only for the next text row (index n + step + 1) that never came
        return None if self._next_text(r) is not None else len(r.prompt) + r.step + 2

    def _ready(self, r: _Req25) -> bool:
        if r.done is not None or self._no_audio(r):
            return True
        if self._starved(r) is not None:
            return True       # will end with an error: the rows never came
        return self._can_prefill(r) or self._can_decode(r)

    def _settle(self, r: _Req25) -> None:
        if r.done is not None:
            return
        if self._no_audio(r):
            r.done = "stop"
        elif (need := self._starved(r)) is not None:
            what = "the prefill" if r.cache is None else f"decode step {r.step + 1}"
            r.done, r.frames, r.error = "error", [], (f"request {r.rid}: the thinker's stream ended with {r.n_rows} "
                                                      f"thinker_hidden row(s); {what} needs {need}")

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return self.talker.thinker_to_talker_proj(x)

    def _prefill_embeds(self, r: _Req25) -> torch.Tensor:
        gen, _ = self._gen(r)
        return edges.prefill_rows(self.talker, self.embed, self.ids, r.prompt, gen[0], r.speaker_bos,
                                  self._rows(r)[:len(r.prompt) + 1], self.codec_rows)

    def _sample(self, chosen: list[_Req25], logits: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        emb = self.talker.get_input_embeddings()
        for r, row in zip(chosen, logits):
            row = repetition_penalty(row, r.history, r.penalty)
            frame = len(r.history) - 3      # the 3 prompt codes first
            row = hold_ends(row.masked_fill(self._suppress, float("-inf")), frame, r.min_tokens, self._ends)
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
