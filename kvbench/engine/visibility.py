"""Which keys each query of a step may see: causality inside the new chunk, what the layer hides of its past
(masked replay, the padding of a per-head view), and a sliding window by absolute position."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Window:
    """A sliding-window layer's visibility by absolute position: key k is visible to query q iff q - k < size.
    A free slot's position is -1: outside every window."""

    size: int
    key_positions: torch.Tensor  # [rows or 1, n]
    query_positions: torch.Tensor  # [rows or 1, q]

    def allowed(self, q_start: int, q_end: int, keys: int | None = None, lo: int = 0) -> torch.Tensor:
        """Bool [rows or 1, q_end - q_start, keys - lo]: over keys ``lo`` to ``keys`` (default all)."""
        held = self.key_positions[:, lo:keys]
        gap = self.query_positions[:, q_start:q_end].unsqueeze(-1) - held.unsqueeze(1)
        return (gap < self.size) & (held >= 0).unsqueeze(1)

    def first_keys(self, q_starts: list[int]) -> list[int]:
        """Per query index, the first key index any row may show it: every key before it is at or past the
        window's edge for that query, and so for every later one. Holds whatever order the keys are held in.
        (One sequence's chunk: every row has the same queries.)"""
        edges = self.query_positions[0, q_starts] - self.size  # a key at or before the edge is hidden
        reach = torch.cummax(self.key_positions, dim=-1).values  # sorted, so searchable in any key order
        edges = edges.to(reach.dtype).unsqueeze(0).expand(reach.shape[0], -1).contiguous()
        return torch.searchsorted(reach.contiguous(), edges, right=True).min(dim=0).values.tolist()


def visibility(
    past: int,
    q_start: int,
    q_end: int,
    n: int,
    visible_past: torch.Tensor | None,
    device: torch.device,
    window: Window | None = None,
    lo: int = 0,
) -> torch.Tensor:
    """Bool [heads or 1, q_end - q_start, n - lo]: key j (from ``lo``) is visible to chunk query i."""
    rows = torch.arange(q_start, q_end, device=device).unsqueeze(-1) + past
    allowed = (torch.arange(lo, n, device=device).unsqueeze(0) <= rows).unsqueeze(0)
    if visible_past is not None:
        allowed = allowed.repeat(visible_past.shape[0], 1, 1)
        if lo < past:
            allowed[:, :, : past - lo] &= visible_past[:, lo:].unsqueeze(1)
    if window is not None:
        allowed = allowed & window.allowed(q_start, q_end, n, lo)
    return allowed


@dataclass(frozen=True)
class KeyAccess:
    """How one step's queries see its keys, as every attention kernel reads it (built once per layer and step):
    the family's ``scaling`` and logit ``softcap``, the ``past`` keys held before the step's queries, what the
    layer hides (``visible``: [rows, past] for a prompt chunk, [rows, n] for a decode step; None: nothing) and
    the sliding ``window`` (None: none)."""

    scaling: float
    past: int = 0
    visible: torch.Tensor | None = None
    window: Window | None = None
    softcap: float | None = None
