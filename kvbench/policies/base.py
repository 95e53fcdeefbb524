"""A policy is an importance score, an eviction scope and a budget allocation (RoCo's split).

``select`` keeps, per KV head, every token the scope protects and fills the rest of the budget
with the highest-scoring candidates. Named policies only choose the parts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class TokenState:
    """What a layer holds right now, per KV head: ``keys`` [H, n, D], ``positions`` [H, n], stats [H, n]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    stats: dict[str, torch.Tensor]
    layer_idx: int
    generator: torch.Generator | None = None

    @property
    def length(self) -> int:
        return self.positions.shape[-1]


class Score(ABC):
    """Importance of each held token; higher is kept first."""

    # Per-token statistics the score reads from ``TokenState.stats`` (see engine.cache.STAT_NAMES).
    needs: frozenset[str] = frozenset()

    @abstractmethod
    def __call__(self, state: TokenState) -> torch.Tensor:
        """Scores, float [kv_heads, n]."""


class Scope(ABC):
    """Which tokens may be evicted: returns the *protected* set."""

    needs: frozenset[str] = frozenset()

    @abstractmethod
    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        """Bool [kv_heads, n]; at most ``budget`` True per head."""

    def min_budget(self) -> int:
        """The smallest budget this scope can honour (its fixed protections plus one candidate)."""
        return 1


def resolve_count(amount: float | int, total: int) -> int:
    """A fraction of ``total`` (float in [0, 1]) or an absolute count (int)."""
    if isinstance(amount, float) and amount <= 1.0:
        return int(round(amount * total))
    return int(amount)


@dataclass
class Policy:
    name: str
    score: Score
    scope: Scope
    evicts: bool = True
    extra_needs: frozenset[str] = field(default_factory=frozenset)

    @property
    def needs(self) -> frozenset[str]:
        return self.score.needs | self.scope.needs | self.extra_needs

    @property
    def needs_attention(self) -> bool:
        return bool(self.needs & {"acc", "sumsq", "last", "hits"})

    def select(self, state: TokenState, budget: int) -> torch.Tensor:
        """Indices to keep, [kv_heads, budget], ascending so kept tokens stay in sequence order."""
        scores = self.score(state).to(torch.float32)
        protected = self.scope.protected(state, budget)
        scores = scores.masked_fill(protected, float("inf"))
        keep = torch.topk(scores, budget, dim=-1, sorted=False).indices
        return keep.sort(dim=-1).values
