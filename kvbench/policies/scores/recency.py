"""Recency: newer tokens matter more (StreamingLLM, sliding window)."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("recency")
class Recency(Score):
    """The score is the absolute position."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.positions.to(torch.float32)
