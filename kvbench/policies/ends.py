"""The two ends of each head's entries: the oldest (attention sinks) and the newest (a recent window).

A layer keeps each head's tokens in sequence order (compaction preserves order, new tokens are appended), so
"oldest" and "newest" are slices of each head's entries. Under per-head allocation heads hold different counts:
entries are front-aligned and ``state.valid`` marks them, so "newest" ends at each head's own length.
"""

from __future__ import annotations

import torch

from kvbench.policies.state import TokenState


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
