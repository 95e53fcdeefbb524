"""Attention sinks and a recent window (StreamingLLM, H2O, SnapKV's window...)."""

from __future__ import annotations

import torch

from kvbench.budget import share
from kvbench.policies.base import Scope
from kvbench.policies.ends import first_n, last_n, shield_ends
from kvbench.policies.parts import register_scope
from kvbench.policies.state import TokenState


@register_scope("sinks_window")
class SinksWindow(Scope):
    """Protect the first ``n_sink`` tokens and a recent window (a fraction of the budget or a count)."""

    def __init__(self, n_sink: int = 4, window: float | int = 0):
        self.n_sink = int(n_sink)
        self.window = window
        if self.n_sink < 0 or window < 0:
            raise ValueError(f"n_sink={n_sink} and window={window} must be >= 0")
        if isinstance(window, float) and window > 1.0:  # kvbench.budget.share: a fraction or an int count
            raise ValueError(f"scope.window={window} must be a fraction in [0, 1] of the budget or an integer count")

    def window_size(self, budget: int) -> int:
        return min(share(self.window, budget), budget - min(self.n_sink, budget))

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        sinks, window = min(self.n_sink, budget), self.window_size(budget)
        if state.valid is None:
            return first_n(state, sinks) | last_n(state, window)
        # Heads of different lengths, in a few ops: each head's first entries and the last ones before its length.
        idx = torch.arange(state.length, device=state.positions.device).unsqueeze(0)
        ends = idx >= state.lengths().unsqueeze(1) - window
        if sinks > 0:
            ends |= idx < sinks
        return ends & state.valid

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        if state.valid is not None:
            return super().shield(scores, state, budget)
        return shield_ends(scores, min(self.n_sink, budget), self.window_size(budget))

    def min_budget(self) -> int:
        return self.n_sink + 1

    def reserved(self, budget: int) -> int:
        return min(budget, min(self.n_sink, budget) + self.window_size(budget))
