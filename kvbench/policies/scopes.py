"""Eviction scopes: which tokens are shielded from eviction whatever their score."""
from __future__ import annotations

import torch

from kvbench.policies.base import Scope, TokenState, resolve_count


# A layer keeps its tokens in sequence order (compaction preserves order, new tokens are appended),
# so "oldest" and "newest" are plain slices of the buffer.


def first_n(state: TokenState, n: int) -> torch.Tensor:
    """The ``n`` oldest held tokens of each head (attention sinks)."""
    mask = torch.zeros_like(state.positions, dtype=torch.bool)
    mask[:, : max(n, 0)] = True
    return mask


def last_n(state: TokenState, n: int) -> torch.Tensor:
    """The ``n`` newest held tokens of each head."""
    mask = torch.zeros_like(state.positions, dtype=torch.bool)
    if n > 0:
        mask[:, -n:] = True
    return mask


class Everything(Scope):
    """Every token is a candidate."""

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        return torch.zeros_like(state.positions, dtype=torch.bool)


class SinksAndWindow(Scope):
    """Protect the first ``n_sink`` tokens and a recent window (a fraction of the budget or a count)."""

    def __init__(self, n_sink: int = 4, window: float | int = 0):
        self.n_sink = int(n_sink)
        self.window = window

    def window_size(self, budget: int) -> int:
        return min(resolve_count(self.window, budget), budget - min(self.n_sink, budget))

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        sinks = min(self.n_sink, budget)
        return first_n(state, sinks) | last_n(state, self.window_size(budget))

    def min_budget(self) -> int:
        return self.n_sink + 1


SCOPES: dict[str, type[Scope]] = {"all": Everything, "sinks_window": SinksAndWindow}
