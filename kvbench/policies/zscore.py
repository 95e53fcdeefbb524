"""Scores standardised over each (layer, sequence): kvpress z-scores a layer's scores over all its heads and
tokens at once (one sequence), which keeps every head's ranking and puts two scores on one scale before a blend
(Compactor)."""

from __future__ import annotations

import torch


def unit_zscore(scores: torch.Tensor, valid: torch.Tensor | None, units: int) -> torch.Tensor:
    """``scores`` [rows, n] minus the mean of their unit's entries, over their standard deviation (Bessel's
    correction, as ``torch.std``; at least 1e-6), padding (``valid`` False) left out. ``units``: the rows come in
    that many equal blocks of heads (``TokenState.units``)."""
    x = scores.to(torch.float32).reshape(units, -1)
    mask = torch.ones_like(x) if valid is None else valid.reshape(units, -1).to(x.dtype)
    count = mask.sum(dim=1, keepdim=True)
    mean = (x * mask).sum(dim=1, keepdim=True) / count.clamp_min(1)
    var = (((x - mean) * mask) ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp_min(1)
    return ((x - mean) / var.sqrt().clamp_min(1e-6)).reshape(scores.shape)
