"""A threshold on any score (DMS-style eviction): each row keeps what scores well, however much that is."""

from __future__ import annotations

import torch

from kvbench.policies.allocations.adaptive import extreme
from kvbench.policies.base import Allocation
from kvbench.policies.parts import register_allocation


@register_allocation("threshold")
class Threshold(Allocation):
    """Once an entry leaves each row's ``window`` newest entries, it is evicted if its score is below
    ``threshold`` (protected entries, at +inf, always pass): the kept count follows the input, row by row.

    The decision is taken at every evicting step, whatever the budget, on the score as it is then. The budget is
    a cap: a row never keeps more than ``budget`` entries (its protected and its newest ``min(window, budget)``
    entries first, the newer first among them, then the highest scores), so
    ``budget=1.0`` is the threshold alone. Rows really hold what they keep (per-head lengths), so the kept tokens
    and resident bytes a run reports are the threshold's, not the budget's.

    kvpress's DMSPress (a dense-prefill DMS without its trained evictors) scores each token once, when it is
    written, and decides once, when it leaves the window; with a score fixed at writing (``key_norm``) that is
    this rule, with ``budget=1.0``.

    ``pooled``: the score sees every layer of a sequence at once (``Allocation.pools_layers``), for a score that
    decides across layers (DuoAttention ranks every KV head of the sequence); each row still keeps its own.
    """

    per_head = True
    thresholded = True

    def __init__(self, threshold: float, window: int = 128, pooled: bool = False):
        if int(window) < 0:
            raise ValueError(f"window={window} must be >= 0 entries")
        self.threshold = float(threshold)
        self.window = int(window)
        self.pools_layers = bool(pooled)

    def keep(self, scores: torch.Tensor, valid: torch.Tensor | None, budget: int, units: int = 1) -> torch.Tensor:
        valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
        index = torch.arange(scores.shape[-1], device=scores.device)
        recent = (index >= valid.sum(dim=-1, keepdim=True) - min(self.window, budget)) & valid
        passing = ((scores >= self.threshold) | recent) & valid
        if int(passing.sum(dim=-1).max()) <= budget:
            return passing
        ranked = scores.masked_fill(recent, float("inf")).masked_fill(~passing, float("-inf")).flip(-1)
        cap = torch.full((scores.shape[0],), budget, device=scores.device)
        return passing & extreme(ranked, cap, largest=True).flip(-1)  # flipped: ties go to the newer entries

    def describe(self) -> str:
        pooled = ", pooled" if self.pools_layers else ""
        return f"threshold({self.threshold:g}, window={self.window}{pooled})"
