"""Orderings within groups of a row's entries (LagKV's lag blocks, ChunkKV's chunks), sorted rather than looped.

A group is a long label per entry, [H, n], in ``[0, slots]``; the scores that use these helpers rank an entry by its
place in its group, or by its group's place first."""

from __future__ import annotations

import torch


def lexicographic(first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """The indices that sort each row by ``first``, then by ``then``, then by index, ascending: long [H, n]."""
    by_then = torch.sort(then, dim=-1, stable=True).indices
    return by_then.gather(1, torch.sort(first.gather(1, by_then), dim=-1, stable=True).indices)


def places(order: torch.Tensor) -> torch.Tensor:
    """Each entry's place in ``order`` (the indices a sort gave), long [H, n]: the inverse permutation."""
    place = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, place)


def depth_in_group(scores: torch.Tensor, group: torch.Tensor, slots: int) -> torch.Tensor:
    """How many entries of its group come before each entry, the group sorted by ``scores`` descending (ties: the
    earlier entry first), long [H, n]."""
    order = lexicographic(group, -scores)
    counts = torch.zeros(group.shape[0], slots + 1, dtype=torch.long, device=group.device)
    counts.scatter_add_(1, group, torch.ones_like(group))
    start = counts.cumsum(dim=1) - counts
    return places(order) - start.gather(1, group)
