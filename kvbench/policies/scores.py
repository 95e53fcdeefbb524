"""Importance scores. Each maps a layer's ``TokenState`` to a float [kv_heads, n]; higher survives."""
from __future__ import annotations

import torch

from kvbench.policies.base import Score, TokenState


class Recency(Score):
    """Newer tokens matter more: the score is the absolute position."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.positions.to(torch.float32)


class RandomScore(Score):
    """Uniform random scores from the cache's seeded generator: evicts a uniformly random subset."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return torch.rand(
            state.positions.shape, generator=state.generator, device=state.positions.device, dtype=torch.float32
        )


SCORES: dict[str, type[Score]] = {"recency": Recency, "random": RandomScore}
