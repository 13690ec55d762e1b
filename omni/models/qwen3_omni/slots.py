"""The host side of the talkers' static step: which request holds which slot, what each row feeds,
and what the one copied-back tensor means.

Slots stay packed (requests 0..n-1): a finished or aborted request's slot takes the last slot's
request, so a decode batch is always the prefix 0..n-1 of the device state. A request gets a
slot when it prefills; with every slot taken, new requests wait (first come, first served).
The host mirrors each request's position and frame count itself (it knows how many rows it
fed), so it never reads them back. `SlotRunner` is the part both talkers share; a talker's
subclass says what a row feeds (`inputs`), what its prefill is (`prefill_rows`, `admit`), when a
request ends before it gets a slot (`settle`) and what a copied row means (`apply`).
"""

from __future__ import annotations

import logging
import time

import torch

from omni.models.qwen3_omni import edges
from omni.models.qwen3_omni.static_step import LENGTH, STOP, StaticTalker

logger = logging.getLogger(__name__)

IN_SLOT = object()     # a request's cache and next input while they live in its slot


class SlotRunner:
    def __init__(self, engine, device_step, graphs=None):
        self.engine = engine
        self.dev = device_step
        self.graphs = graphs
        self.owner: list = []          # slot -> request

    def free(self) -> int:
        return self.dev.slots - len(self.owner)

    def release(self, r) -> None:
        """Free r's slot, moving the last slot's request into it."""
        i, last = r.slot, len(self.owner) - 1
        if i is None:
            return
        if i != last:
            self.dev.move(last, i)
            self.engine._stats["slot_moves"] += 1
            moved = self.owner[last]
            moved.slot = i
            self.owner[i] = moved
        self.owner.pop()
        self.dev.pos[last].zero_()      # an empty slot's masked writes stay inside the cache
        r.slot = None

    def engine_step(self) -> list:
        """The engine's step on this path: new requests prefill into free slots, requests in slots step
        one frame, the outputs go out in the engine's chunks."""
        e = self.engine
        t0 = time.perf_counter()
        prefill, decode = [], []
        free = self.free()
        for r in list(e._reqs.values()):
            self.settle(r)
            if r.done is not None:
                self.release(r)       # settled in its slot (Qwen2.5: a row that never came)
                continue
            if r.slot is not None:
                if e._can_decode(r):
                    decode.append(r)
            elif len(prefill) < free and e._can_prefill(r):
                prefill.append(r)
        if prefill or decode:
            self.step(prefill, decode)
            e._stats["talker_seconds"] += time.perf_counter() - t0
            e._stats["talker_steps"] += 1
        return e._emit()

    def step(self, prefill: list, decode: list) -> None:
        """Prefill `prefill` (new requests, at most `free()`), step `decode` (requests in slots) by one
        frame each, and apply the frames to the requests."""
        dev = self.dev
        full = [r for r in decode if r.pos >= dev.length]
        for r in full:
            r.done = "length"        # the cache is full: as a max_tokens end
        decode = [r for r in decode if r.done is None]
        outs, rows = [], []
        if decode:
            stepping = {id(r) for r in decode}
            outs.append(self._decode(decode, stepping))
            rows.extend(r if id(r) in stepping else None for r in self.owner)
        first, hidden = [], []
        for r in prefill:
            h = self._prefill(r)
            if h is not None:
                first.append(r)
                hidden.append(h)
        if first:
            outs.append(self._first_frames(first, torch.stack(hidden)))
            rows.extend(first)
        if outs:
            codes = dev.to_host(torch.cat(outs) if len(outs) > 1 else outs[0])
            for r in decode:
                r.step += 1
                r.pos += 1
            for r, row in zip(rows, codes):
                if r is not None:
                    r.history.append(int(row[0]))
                    self.apply(r, row[:-1], int(row[-1]))
        for r in full + decode + first:
            if r.done is not None:
                self.release(r)

    def _decode(self, decode: list, stepping: set[int]) -> torch.Tensor:
        n = len(self.owner)
        go = [int(id(r) in stepping) for r in self.owner]
        blank = [0] * self.dev.inputs.shape[0]
        rows = [self.inputs(r) + [1] if g else blank for r, g in zip(self.owner, go)]
        self.dev.load_inputs([list(c) for c in zip(*rows)])
        if len(decode) > 1:
            self.engine._stats["batched_decodes"] += 1
        if self.graphs is not None and self.graphs.covers(n):
            self.engine._stats["graph_replays"] += 1
            return self.graphs.run(n)
        width = max(r.pos for r in decode) + 1
        masked = any(r.pos != width - 1 for r in decode)
        sampled = any(r.uniforms is not None for r in decode)
        return self.dev.decode(n, width, masked, sampled)

    def _first_frames(self, first: list, hidden: torch.Tensor) -> torch.Tensor:
        slots = [r.slot for r in first]
        out = None if self.graphs is None else self.graphs.first(hidden, slots)
        if out is not None:
            self.engine._stats["first_frame_replays"] += 1
            return out
        return self.dev.first_frames(hidden, slots, any(r.uniforms is not None for r in first))

    def _prefill(self, r) -> torch.Tensor | None:
        try:
            x = self.prefill_rows(r)
            if x.shape[0] >= self.dev.length:
                raise ValueError(f"the talker prefill has {x.shape[0]} rows; max_model_len {self.dev.length} "
                                 f"leaves no room to decode")
        except ValueError as err:
            r.done, r.frames, r.error = "error", [], f"request {r.rid}: {err}"
            return None
        r.slot = len(self.owner)
        self.owner.append(r)
        try:
            h = self.admit(r, x)
        except torch.OutOfMemoryError:        # this request's prefill is too large here: its error, the loop lives
            self.release(r)
            r.done, r.frames = "error", []
            r.error = f"request {r.rid}: out of device memory in the talker prefill ({x.shape[0]} rows)"
            if x.is_cuda:
                torch.cuda.empty_cache()
            return None
        r.cache = IN_SLOT
        r.pos = x.shape[0]
        self.engine._stats["prefill_tokens"] += x.shape[0]
        return h

    def admit(self, r, x: torch.Tensor, **extra) -> torch.Tensor:
        c = r.code0
        u = None if r.uniforms is None else r.uniforms.rows(min(r.max_tokens, self.dev.length))
        return self.dev.admit(r.slot, x, penalty=r.penalty, temperature=c.temperature, top_k=c.top_k,
                              top_p=c.top_p, max_tokens=r.max_tokens, uniforms=u, min_tokens=r.min_tokens, **extra)

    # -- the talker's part ----------------------------------------------------------

    def settle(self, r) -> None:
        """End a request that will never need a slot, or can never step again in one (the engine says when)."""
        self.engine._settle(r)

    def inputs(self, r) -> list[int]:
        """What decode step `r.step` feeds (the caller checked it is there): the thinker id of its text row."""
        trailing, _ = self.engine._text(r)
        if r.step < len(trailing):
            return [trailing[r.step]]
        ids = self.engine.ids
        return [ids.tts_eos if r.step == len(trailing) else ids.tts_pad]

    def prefill_rows(self, r) -> torch.Tensor:
        e = self.engine
        return edges.prefill_embeds(e.talker, e.embed, e.ids, r.prompt, r.generated[0], r.speaker_id,
                                    r.mm_hidden, e._tts)

    def apply(self, r, codes, status: int) -> None:
        """One frame (a numpy row of codes and its status) into the request."""
        if status == STOP:
            r.done = "stop"
        elif status == LENGTH:
            r.done = "length"     # as transformers: the last code 0 gets no residual codes
        else:
            r.frames.append(torch.from_numpy(codes.copy()))
            r.next_codec = IN_SLOT
            self.engine._stats["frames"] += 1


def check_static_args(slots: int, max_model_len: int) -> None:
    if slots < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {slots}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")


def with_graphs(runner: SlotRunner, enforce_eager: bool) -> SlotRunner:
    """CUDA graphs of the runner's frame, unless enforce_eager or not on CUDA."""
    from omni.models.qwen3_omni.graphs import FrameGraphs, buckets

    if runner.dev.device.type == "cuda" and not enforce_eager:
        try:
            with torch.no_grad():
                runner.graphs = FrameGraphs(runner.dev, buckets(runner.dev.slots))
        except RuntimeError as e:       # out of memory, a kernel capture refuses: serve, slower, and say so
            logger.warning("talker: CUDA graph capture failed (%s); its frames run launched op by op, several "
                           "times slower (enforce_eager: true skips the capture)", e)
            torch.cuda.empty_cache()
    return runner


def static_runner(engine, slots: int, max_model_len: int, moe_impl: str, enforce_eager: bool) -> SlotRunner:
    """The Qwen3 talker's static step: device state, and CUDA graphs unless enforce_eager (or on CPU)."""
    from omni.models.qwen3_omni.moe import IMPLS

    check_static_args(slots, max_model_len)
    if moe_impl not in IMPLS:
        raise ValueError(f"moe_impl must be one of {', '.join(IMPLS)}, got {moe_impl!r}")
    with torch.no_grad():
        dev = StaticTalker(engine.talker, engine.embed, engine._suppress, engine.ids.codec_eos, slots=slots,
                           max_model_len=max_model_len, moe_impl=moe_impl, residual=engine.residual)
    return with_graphs(SlotRunner(engine, dev), enforce_eager)
