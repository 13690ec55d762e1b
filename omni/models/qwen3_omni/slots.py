"""The host side of the talker's static step: which request holds which slot, what each row feeds,
and what the one copied-back tensor means.

Slots stay packed (requests 0..n-1): a finished or aborted request's slot takes the last slot's
request, so a decode batch is always the prefix 0..n-1 of the device state. A request gets a
slot when it prefills; with every slot taken, new requests wait (first come, first served).
The host mirrors each request's position and frame count itself (it knows how many rows it
fed), so it never reads them back.
"""

from __future__ import annotations

import logging

import torch

from omni.models.qwen3_omni import edges
from omni.models.qwen3_omni.static_step import EOS, LENGTH, StaticTalker

logger = logging.getLogger(__name__)

IN_SLOT = object()     # a request's cache and next input while they live in its slot


class SlotRunner:
    def __init__(self, engine, device_step: StaticTalker, graphs=None):
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

    def text_id(self, r) -> int:
        """The thinker id whose text row decode step `r.step` consumes (the caller checked it is there)."""
        trailing, _ = self.engine._text(r)
        if r.step < len(trailing):
            return trailing[r.step]
        ids = self.engine.ids
        return ids.tts_eos if r.step == len(trailing) else ids.tts_pad

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
            sampled = any(r.uniforms is not None for r in first)
            outs.append(dev.first_frames(torch.stack(hidden), [r.slot for r in first], sampled))
            rows.extend(first)
        if outs:
            codes = dev.to_host(torch.cat(outs) if len(outs) > 1 else outs[0])
            for r in decode:
                r.step += 1
                r.pos += 1
            for r, row in zip(rows, codes):
                if r is not None:
                    self._apply(r, row)
        for r in full + decode + first:
            if r.done is not None:
                self.release(r)

    def _apply(self, r, row) -> None:
        """One frame's codes and status (a numpy row [17]) into the request."""
        r.history.append(int(row[0]))
        status = int(row[-1])
        if status == EOS:
            r.done = "stop"
        elif status == LENGTH:
            r.done = "length"     # as transformers: the last code 0 gets no residual codes
        else:
            r.frames.append(torch.from_numpy(row[:-1].copy()))
            r.next_codec = IN_SLOT
            self.engine._stats["frames"] += 1

    def _decode(self, decode: list, stepping: set[int]) -> torch.Tensor:
        n = len(self.owner)
        go = [int(id(r) in stepping) for r in self.owner]
        ids = [self.text_id(r) if g else 0 for r, g in zip(self.owner, go)]
        self.dev.load_inputs(ids, go)
        if len(decode) > 1:
            self.engine._stats["batched_decodes"] += 1
        if self.graphs is not None and self.graphs.covers(n):
            self.engine._stats["graph_replays"] += 1
            return self.graphs.run(n)
        width = max(r.pos for r in decode) + 1
        masked = any(r.pos != width - 1 for r in decode)
        sampled = any(r.uniforms is not None for r in decode)
        return self.dev.decode(n, width, masked, sampled)

    def _prefill(self, r) -> torch.Tensor | None:
        e = self.engine
        try:
            x = edges.prefill_embeds(e.talker, e.embed, e.ids, r.prompt, r.generated[0], r.speaker_id,
                                     r.mm_hidden, e._tts)
            if x.shape[0] >= self.dev.length:
                raise ValueError(f"the talker prefill has {x.shape[0]} rows; max_model_len {self.dev.length} "
                                 f"leaves no room to decode")
        except ValueError as err:
            r.done, r.frames, r.error = "error", [], f"request {r.rid}: {err}"
            return None
        r.slot = len(self.owner)
        self.owner.append(r)
        code0 = r.code0
        u = None if r.uniforms is None else r.uniforms.rows(min(r.max_tokens, self.dev.length))
        h = self.dev.admit(r.slot, x, penalty=r.penalty, temperature=code0.temperature, top_k=code0.top_k,
                           top_p=code0.top_p, max_tokens=r.max_tokens, uniforms=u)
        r.cache = IN_SLOT
        r.pos = x.shape[0]
        e._stats["prefill_tokens"] += x.shape[0]
        return h


def static_runner(engine, slots: int, max_model_len: int, moe_impl: str | None, enforce_eager: bool) -> SlotRunner:
    """The static step for a talker engine: device state, and CUDA graphs unless enforce_eager (or on CPU)."""
    from omni.models.qwen3_omni.graphs import FrameGraphs, buckets
    from omni.models.qwen3_omni.moe import IMPLS, default_impl

    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    tc = engine.talker.config.text_config
    impl = moe_impl or default_impl(engine.device, engine.embed.dtype, tc.num_experts)
    if impl not in IMPLS:
        raise ValueError(f"moe_impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    with torch.no_grad():
        dev = StaticTalker(engine.talker, engine.embed, engine._suppress, engine.ids.codec_eos, slots=slots,
                           max_model_len=max_model_len, moe_impl=impl)
        graphs = None
        if engine.device.type == "cuda" and not enforce_eager:
            graphs = FrameGraphs(dev, buckets(slots))
    return SlotRunner(engine, dev, graphs)
