"""CUDA graphs of the talker's static frame, one per batch bucket, captured at start-up.

A frame (talker step, code 0, 15 code-predictor steps, sampling, end detection) is ~100 x
(layers) kernel launches whose GPU work is microseconds each; replaying a captured graph
launches them all at once. Each bucket's graph decodes slots 0..b-1 over the whole cache
width with a position mask; a batch of n requests replays the smallest bucket >= n (rows
past n are empty slots, masked out). What a graph cannot hold stays outside it: the prefill
(its length varies; it runs eagerly, once per request) and its first frame, the host-to-device
copy of the step's inputs and the device-to-host copy of its codes. CPU: not used.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (vLLM's capture sizes), max_batch included."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class FrameGraphs:
    def __init__(self, dev, sizes: list[int]):
        self.dev = dev
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        t0 = time.perf_counter()
        dev.load_inputs([])           # no row steps: warm-up and capture leave every slot as it was
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):    # largest first, so smaller graphs fit in its memory
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._frame(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._frame(b)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t0
        logger.info("talker: captured %d CUDA graphs (batch %s) in %.2f s", len(self.sizes), self.sizes, self.seconds)

    def _frame(self, b: int) -> torch.Tensor:
        return self.dev.decode(b, self.dev.length, masked=True, sampled=True)

    def covers(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, n: int) -> torch.Tensor:
        """Replay the smallest bucket holding n rows (inputs already loaded) -> its output's first n rows."""
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
