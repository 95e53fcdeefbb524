"""H2O's heavy hitters."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("accumulated")
class Accumulated(Score):
    """The attention probability a token received, summed over every query that saw it."""

    needs = frozenset({"acc"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.stats["acc"]
