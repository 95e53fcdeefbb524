"""Ada-KV: inside a layer, heads get different budgets from the score distribution, same layer total. The cache
then stores per-head lengths (engine.cache.PooledLayer)."""

from __future__ import annotations

import math

import torch

from kvbench.policies.base import Allocation
from kvbench.policies.parts import register_allocation


@register_allocation("adaptive")
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
