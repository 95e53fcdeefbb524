"""Per-layer budgets from real-valued shares: clipped to what a layer can hold, then whole tokens with the
allocation's exact total. Shared by the allocations that weight layers differently (pyramid, profiled)."""

from __future__ import annotations

import math


def fit_total(raw: list[float], lo: float, hi: float, total: float) -> list[float]:
    """Clip to [lo, hi] and spread the difference to ``total`` evenly over the layers that can still move."""
    vals = [min(max(v, lo), hi) for v in raw]
    for _ in range(len(vals) + 1):
        diff = total - sum(vals)
        if abs(diff) < 1e-9:
            break
        free = [i for i, v in enumerate(vals) if (v < hi if diff > 0 else v > lo)]
        if not free:
            break
        for i in free:
            vals[i] = min(max(vals[i] + diff / len(free), lo), hi)
    return vals


def integer_split(vals: list[float], lo: float, hi: float, total: int) -> list[int]:
    """Round down, then hand the remaining units to the largest fractional parts (within [lo, hi])."""
    out = [int(math.floor(v + 1e-9)) for v in vals]
    order = sorted(range(len(vals)), key=lambda i: (-(vals[i] - out[i]), i))
    k = 0
    while sum(out) < total and k < 4 * len(out):
        i = order[k % len(out)]
        if out[i] + 1 <= hi:
            out[i] += 1
        k += 1
    return out
