"""``shared: true`` on any score: one kept set per layer (TOVA's layer-wise choice). A wrapper, not a kind."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score, ScoreWrapper
from kvbench.policies.state import TokenState


class SharedAcrossHeads(ScoreWrapper):
    """The inner score averaged over the layer's KV heads. Needs heads holding the same tokens: the uniform
    allocation, or a threshold (every head then keeps the same set, so per-head lengths stay equal)."""

    def __init__(self, inner: Score):
        super().__init__(inner)
        self.shares_heads = True

    def __call__(self, state: TokenState) -> torch.Tensor:
        if state.valid is not None and bool((state.per_unit(state.lengths()).diff(dim=1) != 0).any()):
            raise ValueError("shared: true needs heads holding the same tokens; it cannot run with per-head allocation")
        scores = self.inner(state).to(torch.float32)
        per_unit = state.per_unit(scores)  # each (layer, sequence) chooses its own
        return per_unit.mean(dim=1, keepdim=True).expand_as(per_unit).reshape(scores.shape)
