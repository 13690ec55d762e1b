"""Percentiles as the benchmarks here report them."""

from __future__ import annotations

import statistics


def pct(xs, q: float) -> float:
    """The q quantile (0..1) of xs: the median for 0.5 (of [1, 2]: 1.5), else the nearest rank
    round(q * (n - 1)). Empty xs is an error: a caller says what none means."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("no samples")
    if q == 0.5:
        return statistics.median(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
