"""TOVA's score."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("last")
class Last(Score):
    """The attention probability from the most recent query only."""

    needs = frozenset({"last"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.stats["last"]
