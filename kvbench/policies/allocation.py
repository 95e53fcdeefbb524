"""Budget allocation: how the token budget splits across layers and across the KV heads of a layer.

- ``uniform``: every layer and every head holds ``budget`` tokens.
- ``pyramid`` (PyramidKV): more budget in lower layers, decreasing linearly with depth, same total.
- ``adaptive`` (Ada-KV): inside a layer, heads get different budgets from the score distribution, same
  layer total. The cache then stores per-head lengths (engine.cache.PooledLayer).
"""

from __future__ import annotations

import math

import torch

from kvbench.policies.base import Allocation


class Uniform(Allocation):
    """Every layer and every head keeps ``budget`` tokens."""


class Pyramid(Allocation):
    """PyramidKV's layer budgets: a linear ramp from the bottom layer to the top, same total.

    With r the scope's reserved tokens (sinks + recent window, kept in every layer) and f = B - r the free
    part of the average budget B, the top layer gets r + f/β and the bottom r + 2f - f/β, linear in between
    (mean B, as in PyramidKV with β = 20). Budgets are then clipped to [min(r + 1, B), limit] (a layer can
    never use more than it will hold, so a budget at least the sequence length evicts nothing anywhere),
    the clipped amount is spread over the other layers, and rounding keeps the exact integer total
    ``min(L·B, L·limit)``.
    """

    def __init__(self, beta: float = 20.0):
        if float(beta) < 1.0:
            raise ValueError(f"beta={beta} must be >= 1 (1 = uniform)")
        self.beta = float(beta)

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None, reserved: int = 0) -> list[int]:
        hi = float(limit) if limit is not None else float("inf")
        if n_layers == 1:
            return [int(min(budget, hi))]
        reserved = min(reserved, budget)
        free = budget - reserved
        top = reserved + free / self.beta
        bottom = reserved + 2 * free - free / self.beta
        raw = [bottom + (top - bottom) * i / (n_layers - 1) for i in range(n_layers)]
        lo = float(min(reserved + 1, budget))
        total = int(min(n_layers * budget, n_layers * hi))
        return integer_split(fit_total(raw, lo, hi, total), lo, hi, total)

    def describe(self) -> str:
        return f"pyramid(beta={self.beta:g})"


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


class Adaptive(Allocation):
    """Ada-KV: the heads of a layer share ``H × budget`` slots, given to the highest scores across heads.

    Each head first keeps its protected entries and at least ⌊floor·budget⌋ of its best entries (Ada-KV's
    safeguard against starving a head; floor = 0.2 as in the authors' code); the rest of the layer total
    goes to the highest remaining scores, whichever head they are in. Scores must be comparable across heads
    (attention probabilities are: every head's attention sums to one). The cache stores the resulting
    per-head lengths truly ragged (engine.cache.PooledLayer), so memory follows the real kept count.
    """

    per_head = True

    def __init__(self, floor: float = 0.2):
        if not 0.0 <= float(floor) <= 1.0:
            raise ValueError(f"floor={floor} must be a fraction of the budget in [0, 1]")
        self.floor = float(floor)

    def keep(self, scores: torch.Tensor, valid: torch.Tensor | None, budget: int, units: int = 1) -> torch.Tensor:
        """``units`` > 1: the rows are the heads of that many (layer, sequence) units, each splitting its own
        total; they must hold the same count (the cache groups them so)."""
        rows, n = scores.shape
        layers = units
        h = rows // layers
        valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
        lengths = valid.sum(dim=1)
        held = set(lengths.view(layers, h).sum(dim=1).tolist())
        if len(held) != 1:
            raise ValueError(f"units split together must hold the same count, not {sorted(held)}")
        drops = held.pop() - h * budget
        if drops <= 0:
            return valid.clone()
        scores = scores.masked_fill(~valid, float("-inf"))
        protected = torch.isposinf(scores).sum(dim=1)
        floor = torch.minimum(lengths, protected.clamp_min(math.floor(self.floor * budget + 1e-9)))
        excluded = ~valid
        # Each head's best ``floor`` entries are guaranteed (protected ones first: they score +inf). A head
        # holding at least ``floor`` more than the drops keeps them anyway (the usual decode step: a few
        # drops), so they are set aside only in the heads that close to their floor.
        near = (lengths - floor < drops).nonzero().squeeze(1)
        if near.numel():
            excluded[near] |= extreme(scores[near], floor[near], largest=True)
        # Each layer's total: drop the lowest of its other entries, whichever head holds them (there are
        # enough of them: a head's floor never exceeds its budget).
        candidates = scores.masked_fill(excluded, float("inf")).view(layers, h * n)
        dropped = extreme(candidates, torch.full((layers,), drops, device=scores.device), largest=False)
        return valid & ~dropped.view(rows, n)

    def describe(self) -> str:
        return f"adaptive(floor={self.floor:g})"


def extreme(values: torch.Tensor, k: torch.Tensor, largest: bool) -> torch.Tensor:
    """Bool mask of each row's ``k[row]`` largest (or smallest) values, ties going to the earlier columns. topk
    breaks ties by its own layout; this way a row selects the same entries whatever padding follows it, so layers
    ranked together keep what each would alone."""
    most = int(k.max())
    if most == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    ranked = torch.topk(values, most, dim=1, largest=largest, sorted=True).values
    kth = ranked.gather(1, (k - 1).clamp_min(0).unsqueeze(1))
    beyond = values > kth if largest else values < kth
    tied = values == kth
    short = k.unsqueeze(1) - beyond.sum(dim=1, keepdim=True)
    return (beyond | (tied & (tied.cumsum(dim=1) <= short))) & (k.unsqueeze(1) > 0)


ALLOCATIONS: dict[str, type[Allocation]] = {"uniform": Uniform, "pyramid": Pyramid, "adaptive": Adaptive}
