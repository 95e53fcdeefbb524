"""Which keys each query of a step may see: causality inside the new chunk, what the layer hides of its past
(masked replay, the padding of a per-head view), and a sliding window by absolute position."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Window:
    """A sliding-window layer's visibility by absolute position: key k is visible to query q iff q - k < size."""

    size: int
    key_positions: torch.Tensor  # [heads or 1, n]
    query_positions: torch.Tensor  # [q]

    def allowed(self, q_start: int, q_end: int, keys: int | None = None) -> torch.Tensor:
        """Bool [heads or 1, q_end - q_start, keys]: over the first ``keys`` keys (default all)."""
        held = self.key_positions if keys is None else self.key_positions[:, :keys]
        gap = self.query_positions[q_start:q_end].view(1, -1, 1) - held.unsqueeze(1)
        return gap < self.size


def visibility(past: int, q_start: int, q_end: int, n: int, visible_past: torch.Tensor | None,
               device: torch.device, window: Window | None = None) -> torch.Tensor:
    """Bool [heads or 1, q_end - q_start, n]: key j is visible to chunk query i."""
    rows = torch.arange(q_start, q_end, device=device).unsqueeze(-1) + past
    allowed = (torch.arange(n, device=device).unsqueeze(0) <= rows).unsqueeze(0)
    if visible_past is not None:
        allowed = allowed.repeat(visible_past.shape[0], 1, 1)
        allowed[:, :, :past] &= visible_past.unsqueeze(1)
    if window is not None:
        allowed = allowed & window.allowed(q_start, q_end, n)
    return allowed
