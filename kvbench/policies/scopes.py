"""Eviction scopes: which tokens are shielded from eviction whatever their score."""

from __future__ import annotations

import math

import torch

from kvbench.budget import share
from kvbench.policies.base import Scope
from kvbench.policies.scores import attention_variance
from kvbench.policies.state import TokenState

# A layer keeps each head's tokens in sequence order (compaction preserves order, new tokens are appended),
# so "oldest" and "newest" are slices of each head's entries. Under per-head allocation heads hold
# different counts: entries are front-aligned and ``state.valid`` marks them, so "newest" ends at each
# head's own length.


def first_n(state: TokenState, n: int) -> torch.Tensor:
    """The ``n`` oldest held tokens of each head (attention sinks)."""
    mask = torch.zeros_like(state.positions, dtype=torch.bool)
    mask[:, : max(n, 0)] = True
    return mask if state.valid is None else mask & state.valid


def last_n(state: TokenState, n: int) -> torch.Tensor:
    """The ``n`` newest held tokens of each head."""
    mask = torch.zeros_like(state.positions, dtype=torch.bool)
    if n <= 0:
        return mask
    if state.valid is None:
        mask[:, -n:] = True
        return mask
    idx = torch.arange(state.length, device=state.positions.device).unsqueeze(0)
    lengths = state.lengths().unsqueeze(1)
    return (idx >= lengths - n) & (idx < lengths)


def shield_ends(scores: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """A copy of ``scores`` with +inf on the ``first`` oldest and ``last`` newest entries of every head
    (heads of one length); ``scores`` itself when there are none."""
    if first <= 0 and last <= 0:
        return scores
    return fill_ends(scores.clone(), first, last)


def fill_ends(out: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """``shield_ends`` in place."""
    if first > 0:
        out[:, :first] = float("inf")
    if last > 0:
        out[:, -last:] = float("inf")
    return out


class Everything(Scope):
    """Every token is a candidate."""

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        return torch.zeros_like(state.positions, dtype=torch.bool)

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        return scores


class SinksAndWindow(Scope):
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


class Robust(Scope):
    """RoCo's robust scope: protect the ``n_sink`` first tokens, the ``n_recent`` newest and the ⌊ρ·B⌋ tokens
    whose received attention has the highest standard deviation (B = the head's budget).

    ρ depends on the phase the cache is in (``TokenState.phase``): ``rho_prefill`` (0.1) while the prompt is
    compressed, ``rho_decode`` (0.3) while generating, the defaults of the authors' EasyKV. The standard
    deviation is over the queries that could see the token (``policies.scores.attention_mean_std``);
    the std-protected count is capped so that the protected set never exceeds the budget.
    """

    needs = frozenset({"acc", "sumsq", "count"})

    def __init__(self, n_sink: int = 4, n_recent: int = 8, rho_prefill: float = 0.1, rho_decode: float = 0.3):
        self.n_sink = int(n_sink)
        self.n_recent = int(n_recent)
        self.rho_prefill = float(rho_prefill)
        self.rho_decode = float(rho_decode)
        if self.n_sink < 0 or self.n_recent < 0:
            raise ValueError(f"n_sink={n_sink} and n_recent={n_recent} must be >= 0")
        for rho in (self.rho_prefill, self.rho_decode):
            if not 0.0 <= rho <= 1.0:
                raise ValueError(f"rho={rho} must be in [0, 1]")

    def rho(self, phase: str) -> float:
        return self.rho_prefill if phase == "prefill" else self.rho_decode

    def std_count(self, budget: int, phase: str) -> int:
        fixed = min(self.n_sink, budget) + min(self.n_recent, budget - min(self.n_sink, budget))
        return max(0, min(math.floor(self.rho(phase) * budget + 1e-9), budget - fixed))

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        if state.valid is None:  # one definition of the in-order case: shield's
            return self.shield(torch.zeros_like(state.positions, dtype=torch.float32), state, budget).isposinf()
        sinks = min(self.n_sink, budget)
        recent = min(self.n_recent, budget - sinks)
        k = min(self.std_count(budget, state.phase), state.length)
        base = first_n(state, sinks) | last_n(state, recent)
        if k == 0:
            return base
        spread = attention_variance(state)  # ranks as the deviation does
        candidates = spread.masked_fill(base | ~state.valid_mask(), float("-inf"))
        idx = torch.topk(candidates, k, dim=-1, sorted=False).indices
        chosen = torch.zeros_like(base).scatter_(1, idx, True) & torch.isfinite(candidates)
        return base | chosen

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        """Heads of one length: the sinks and the recent window are the two ends of each row, so the std
        candidates are the slice between them (the decode step's path: a handful of ops)."""
        if state.valid is not None:
            return super().shield(scores, state, budget)
        sinks = min(self.n_sink, budget)
        recent = min(self.n_recent, budget - sinks)
        n = state.length
        lo = min(sinks, n)
        hi = max(lo, n - recent)
        out = fill_ends(scores.clone(), lo, n - hi)
        k = min(self.std_count(budget, state.phase), state.length, hi - lo)
        if k > 0:  # the variance ranks as the deviation does
            idx = torch.topk(attention_variance(state)[:, lo:hi], k, dim=-1, sorted=False).indices
            out[:, lo:hi].scatter_(1, idx, float("inf"))
        return out

    def min_budget(self) -> int:
        return self.n_sink + self.n_recent + 1

    def reserved(self, budget: int) -> int:
        return min(budget, self.n_sink + self.n_recent)


SCOPES: dict[str, type[Scope]] = {"all": Everything, "sinks_window": SinksAndWindow, "robust": Robust}
