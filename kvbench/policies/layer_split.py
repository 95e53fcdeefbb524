"""Per-layer budgets from real-valued shares: clipped to what a layer can hold, then whole tokens with the
allocation's exact total. Shared by the allocations that weight layers differently (pyramid, profiled)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fit_total(raw: list[float], lo: float, hi: float | Sequence[float], total: float) -> list[float]:
    """Clip to [lo, hi] and spread the difference to ``total`` evenly over the layers that can still move (``hi``:
    one bound for every layer, or one per layer)."""
    his = list(hi) if isinstance(hi, Sequence) else [hi] * len(raw)
    vals = [min(max(v, lo), h) for v, h in zip(raw, his)]
    for _ in range(len(vals) + 1):
        diff = total - sum(vals)
        if abs(diff) < 1e-9:
            break
        free = [i for i, v in enumerate(vals) if (v < his[i] if diff > 0 else v > lo)]
        if not free:
            break
        for i in free:
            vals[i] = min(max(vals[i] + diff / len(free), lo), his[i])
    return vals


def integer_split(vals: list[float], lo: float, hi: float | Sequence[float], total: int) -> list[int]:
    """Round down, then hand the remaining units to the largest fractional parts (within [lo, hi])."""
    his = list(hi) if isinstance(hi, Sequence) else [hi] * len(vals)
    out = [int(math.floor(v + 1e-9)) for v in vals]
    order = sorted(range(len(vals)), key=lambda i: (-(vals[i] - out[i]), i))
    k = 0
    while sum(out) < total and k < 4 * len(out):
        i = order[k % len(out)]
        if out[i] + 1 <= his[i]:
            out[i] += 1
        k += 1
    return out
