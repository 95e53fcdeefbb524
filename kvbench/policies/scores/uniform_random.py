"""Random eviction: the baseline any score must beat."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("random")
class Random(Score):
    """Uniform random scores: evicts a uniformly random subset, drawn afresh at every step.

    An entry's draw is a hash of the run's seed, its row (layer and KV head), its position and the tokens fed so
    far, so it does not depend on which other rows or sequences are scored with it: a sequence evicts the same
    entries alone or in any batch."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return uniform_hash(state.seed, state.row_keys, state.positions, state.seen)


def uniform_hash(
    seed: int, rows: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor | int | None
) -> torch.Tensor:
    """Floats in [0, 1) from integer inputs (murmur3's 32-bit finaliser over a mix of them), [rows, n]."""
    mask = 0xFFFFFFFF
    seen = torch.as_tensor(0 if seen is None else seen, device=positions.device)
    x = (positions * 2654435761) & mask
    x = x ^ ((rows * 2246822519) & mask) ^ ((seen * 3266489917) & mask) ^ ((int(seed) * 668265263) & mask)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> shift)) * mult) & mask
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) / float(1 << 24)
