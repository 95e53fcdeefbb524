"""The scope that protects nothing: every token is a candidate."""

from __future__ import annotations

import torch

from kvbench.policies.base import Scope
from kvbench.policies.parts import register_scope
from kvbench.policies.state import TokenState


@register_scope("all")
class All(Scope):
    """Every token is a candidate."""

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        return torch.zeros_like(state.positions, dtype=torch.bool)

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        return scores
