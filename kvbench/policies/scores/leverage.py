"""Compactor's approximate leverage scores of the keys (query-agnostic)."""

from __future__ import annotations

import math

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.scores.uniform_random import uniform_hash
from kvbench.policies.state import TokenState
from kvbench.policies.zscore import unit_zscore

RIDGE = 1e-2  # added to XᵀX before its Cholesky factor, and multiplied by 10 (up to 4 times) while that fails
RIDGE_TRIES = 5


@register_score("leverage")
class Leverage(Score):
    """Leverage: a key far outside the span of the others is an outlier the cache should keep. Each row's keys
    before RoPE are centred over the row, sketched on the right by a Gaussian matrix Φ [D, k] (entries of
    variance 1/k), and each key scores its (ridge) leverage in the sketch, xᵢᵀ (XᵀX + λI)⁻¹ xᵢ with X = (K − K̄)Φ,
    z-scored over the layer's heads as kvpress does (Chari & Van Durme 2025, kvpress's LeverageScorePress).

    The sketch is seeded: Φ is a hash of the run's seed and the row's layer and KV head (Box–Muller over
    ``uniform_hash``), the same at every eviction and in any batch. kvpress draws Φ from torch's global
    generator at every call, so its kept sets are random; they agree with these only statistically, except
    with ``sketch_dimension`` ≥ head_dim (where a full-rank Φ leaves the leverage unchanged, up to the ridge λ).
    As kvpress, λ = 0.01, raised tenfold (for the whole group) while a Cholesky factor fails. kvbench computes
    in float32 where kvpress sketches in the model's dtype. The rule needs no query, so it runs in every stage."""

    rope = True

    def __init__(self, sketch_dimension: int = 48):
        if int(sketch_dimension) < 1:
            raise ValueError(f"sketch_dimension={sketch_dimension} must be >= 1")
        self.sketch_dimension = int(sketch_dimension)

    def __call__(self, view: TokenState) -> torch.Tensor:
        keys = view.keys_before_rope
        sketch = gaussian_sketch(view.seed, view.row_keys, keys.shape[-1], self.sketch_dimension)
        return unit_zscore(sketched_leverage(keys, view.valid, sketch), view.valid, view.units)


def gaussian_sketch(seed: int, row_keys: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """[rows, dim, width] independent N(0, 1/width) entries, a function of ``seed`` and each row's key alone."""
    index = torch.arange(dim * width, device=row_keys.device).unsqueeze(0)
    radius = uniform_hash(seed, row_keys, index, 1) + 0.5 / (1 << 24)  # in (0, 1): the log is finite
    angle = uniform_hash(seed, row_keys, index, 2)
    normal = torch.sqrt(-2.0 * torch.log(radius)) * torch.cos(2.0 * math.pi * angle)
    return normal.view(-1, dim, width) / math.sqrt(width)


def sketched_leverage(keys: torch.Tensor, valid: torch.Tensor | None, sketch: torch.Tensor) -> torch.Tensor:
    """Ridge leverage of each row's centred, sketched keys: keys [rows, n, D] (padding: ``valid`` False),
    sketch [rows, D, k] -> [rows, n], zero on padding."""
    keys = keys.to(torch.float32)
    if valid is None:
        centred = keys - keys.mean(dim=1, keepdim=True)
    else:
        mask = valid.unsqueeze(-1).to(keys.dtype)
        mean = (keys * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp_min(1)
        centred = (keys - mean) * mask
    x = centred @ sketch.to(keys.device)
    gram = x.transpose(1, 2) @ x
    gram = 0.5 * (gram + gram.transpose(1, 2))
    eye = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    ridge = RIDGE
    for _ in range(RIDGE_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + ridge * eye)
        if bool((info == 0).all()):  # xᵀ(LLᵀ)⁻¹x = ‖L⁻¹x‖²: one triangular solve, no inverse formed
            return torch.linalg.solve_triangular(factor, x.transpose(1, 2), upper=False).pow(2).sum(dim=1)
        ridge *= 10
    raise RuntimeError(f"leverage: no Cholesky factor of XᵀX + λI up to λ = {ridge / 10:g}")
