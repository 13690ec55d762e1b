"""CUDA graphs of the talker's static frame, one per batch bucket, captured at start-up.

A frame (talker step, code 0, 15 code-predictor steps, sampling, end detection) is ~100 x
(layers) kernel launches whose GPU work is microseconds each; replaying a captured graph
launches them all at once. Each bucket's graph decodes slots 0..b-1 over the whole cache
width with a position mask; a batch of n requests replays the smallest bucket >= n (rows
past n are empty slots, masked out). A prefilled request's first frame (code 0 from the
prefill's last hidden row, then the residual codes) is one more graph per number of prefills
in a step, 1 to FIRST_MAX exactly (a padded row would step a slot in flight); more run eagerly.
What a graph cannot hold stays outside it: the prefill (its length varies; it runs eagerly, once
per request), the host-to-device copies of the step's inputs and the device-to-host copy of its
codes. CPU: not used.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)

FIRST_MAX = 4      # prefills in one step whose first frames replay a graph


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (vLLM's capture sizes), max_batch included."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class FrameGraphs:
    def __init__(self, dev, sizes: list[int]):
        self.dev = dev
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.firsts: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        w = dev.backbone.norm.weight                  # the prefill's hidden rows: the talker's width
        self.first_hidden = torch.zeros((FIRST_MAX, w.shape[0]), dtype=w.dtype, device=dev.device)
        self.first_slots = torch.zeros(FIRST_MAX, dtype=torch.long, device=dev.device)
        t0 = time.perf_counter()
        dev.load_inputs([])           # no row steps: warm-up and capture leave every slot as it was
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):    # largest first, so smaller graphs fit in its memory
            self.graphs[b] = self._capture(self._frame, b, pool)
        # first-frame warm-ups step slot 0 (no request holds it yet; admission resets what they touch)
        for p in range(min(FIRST_MAX, dev.slots), 0, -1):
            self.firsts[p] = self._capture(self._first, p, pool)
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t0
        logger.info("talker: captured %d CUDA graphs (batch %s, first frames 1-%d) in %.2f s",
                    len(self.graphs) + len(self.firsts), self.sizes, len(self.firsts), self.seconds)

    @staticmethod
    def _capture(fn, n: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(n)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(n)
        return graph, out

    def _frame(self, b: int) -> torch.Tensor:
        return self.dev.decode(b, self.dev.length, masked=True, sampled=True)

    def _first(self, p: int) -> torch.Tensor:
        return self.dev.frame_rows(self.first_hidden[:p], self.first_slots[:p], None, sampled=True)

    def covers(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, n: int) -> torch.Tensor:
        """Replay the smallest bucket holding n rows (inputs already loaded) -> its output's first n rows."""
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def first(self, hidden: torch.Tensor, slots: list[int]) -> torch.Tensor | None:
        """The first frames of requests just prefilled into `slots` (hidden [P, H], their prefills'
        last rows) -> codes and status [P, groups + 1]; None when P has no graph."""
        p = len(slots)
        if p not in self.firsts:
            return None
        self.first_hidden[:p].copy_(hidden)
        self.first_slots[:p].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        graph, out = self.firsts[p]
        graph.replay()
        return out
