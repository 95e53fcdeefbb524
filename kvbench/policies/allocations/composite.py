"""KVCompose's composite tokens: each layer's count from its heads' sorted scores, ranked over every layer."""

from __future__ import annotations

import torch

from kvbench.policies.allocations.adaptive import extreme
from kvbench.policies.base import Allocation
from kvbench.policies.parts import register_allocation


@register_allocation("composite")
class Composite(Allocation):
    """KVCompose's structured allocation (Akulov et al. 2025; kvpress's KVComposePress): a layer's *composite
    tokens* are its KV heads' scores, each head's sorted from highest, averaged over the heads rank by rank; the
    first layer's are raised to the most any layer has at each rank; the ``layers × heads × budget`` best
    composite tokens over every layer say how many entries each layer keeps (at least one), and every head of
    the layer keeps that many of its own best entries. The heads of a layer keep the same count at different
    positions, the layers different counts: the cache stores each row at its own length, so resident memory is
    what the rows hold. Rows of one sequence's layers are ranked together (``pools_layers``), the lowest layer
    first."""

    per_head = True
    pools_layers = True

    def keep(self, scores: torch.Tensor, valid: torch.Tensor | None, budget: int, units: int = 1) -> torch.Tensor:
        """``scores`` [rows, n]: ``units`` layers of one sequence, ``rows / units`` heads each, in layer order."""
        rows, n = scores.shape
        valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
        scores = scores.masked_fill(~valid, float("-inf"))
        counts = layer_counts(scores, units, budget)
        per_row = torch.minimum(counts.repeat_interleave(rows // units), valid.sum(dim=1))
        return extreme(scores, per_row, largest=True) & valid

    def describe(self) -> str:
        return "composite"


def layer_counts(scores: torch.Tensor, units: int, budget: int) -> torch.Tensor:
    """How many entries each of the ``units`` layers keeps per head, long [units]."""
    rows, n = scores.shape
    composite = scores.sort(dim=1, descending=True).values.view(units, rows // units, n).mean(dim=1)
    composite[0] = composite.max(dim=0).values
    flat = composite.flatten()
    total = min(units * budget, int((flat > float("-inf")).sum()))
    # Ties go to the lower layer (the first layer's composite equals another's wherever that one is the most).
    picked = extreme(flat.unsqueeze(0), torch.tensor([total], device=flat.device), largest=True).view(units, n)
    return picked.sum(dim=1).clamp_min(1)
