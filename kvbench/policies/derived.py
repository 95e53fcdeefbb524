"""Quantities several parts derive from a layer's statistics, computed once per ``TokenState``.

RoCo's mean attention is a score and the robust scope ranks tokens by the deviation around that same mean;
SnapKV and ScissorHands both read the query log's sum. Each is computed once per state and shared
(``TokenState.derived``).
"""

from __future__ import annotations

import torch

from kvbench.policies.state import TokenState


def clamped_count(state: TokenState) -> torch.Tensor:
    """``count`` floored at 1 (a token no query has seen yet scores 0)."""
    return state.derived("count_min1", lambda s: s.stats["count"].clamp_min(1.0))


def mean_attention(state: TokenState) -> torch.Tensor:
    """Per token, the mean attention probability over the ``count`` queries that could see it: acc / count."""
    return state.derived("mean", lambda s: s.stats["acc"] / clamped_count(s))


def attention_variance(state: TokenState) -> torch.Tensor:
    """Per token, the (population) variance of the attention it received, on the shared mean: E[a²] - mean²,
    which rounding may leave a hair below 0 for a token of (near) constant attention. It ranks tokens as the
    standard deviation does (the square root is increasing), so ranking needs no root."""
    return state.derived(
        "var",
        lambda s: torch.addcmul(s.stats["sumsq"] / clamped_count(s), mean_attention(s), mean_attention(s), value=-1.0),
    )


def logged_sum(state: TokenState) -> torch.Tensor:
    """The query log summed over its rows, [H, n]: all that hit counts and SnapKV read of it."""
    return state.derived("qlog_sum", lambda s: s.stats["qlog"].sum(dim=1))
