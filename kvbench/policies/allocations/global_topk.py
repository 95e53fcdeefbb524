"""KVzip's allocation for any score: one top-k over every layer and KV head of a sequence, each row with a floor."""

from __future__ import annotations

import torch

from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.parts import register_allocation


@register_allocation("global")
class GlobalTopK(Adaptive):
    """Every row (layer, KV head) of a sequence shares ``layers × heads × budget`` entries, given to the highest
    scores wherever they are: Ada-KV's split across heads, widened to every layer (KVzip's default, whose kvpress
    port ranks ``score_val`` over layers, heads and positions at once).

    Each row first keeps its protected entries and at least ⌊floor·budget⌋ of its best ones (Ada-KV's safeguard;
    KVzip has none: ``floor=0``, the default). The cache evicts a sequence's layers together, at the end of a step,
    once every layer has attended, and only when their total is over ``layers × heads × budget``; rows store just
    what they keep (per-head lengths), so resident memory is the budget's, the same as the uniform split's. Scores
    must be comparable across layers as across heads: attention probabilities are (each query's sum to one in
    every layer), norms of keys or values of different layers need not be.
    """

    pools_layers = True

    def __init__(self, floor: float = 0.0):
        super().__init__(floor)

    def keep(self, scores: torch.Tensor, valid: torch.Tensor | None, budget: int, units: int = 1) -> torch.Tensor:
        """``scores`` [rows, n]: every row of one sequence's pooled layers (the cache groups them so)."""
        return super().keep(scores, valid, budget, units=1)

    def describe(self) -> str:
        return f"global(floor={self.floor:g})"
