"""CAKE's eviction indicator (Qin et al. 2025): the window's mean attention plus γ times its variance."""

from __future__ import annotations

import torch

from kvbench.policies.derived import logged_sum
from kvbench.policies.parts import register_score
from kvbench.policies.scores.snapkv import SnapKV, pool_neighbours
from kvbench.policies.state import TokenState


@register_score("cake")
class CakeIndicator(SnapKV):
    """CAKE's indicator of an entry before the observation window (the last ``window`` queries): the mean over the
    window's queries of the attention it received plus ``gamma`` times its variance over them (unbiased, over the
    ``window`` queries), so that a token whose importance shifts within the window is kept too; then, as SnapKV,
    avg-pooled over ``kernel_size`` neighbours of the entries before the window. The window's entries score their
    own mean attention; CAKE always keeps them (the scope protects them, configs/policy/cake.yaml). Attention is
    the KV head's: its GQA group's mean rows, as kvbench's query log keeps them (CAKE averages the indicator over
    the group's query heads). The per-layer budgets are the ``cake`` allocation's."""

    why_unsupported = (
        "CAKE allocates and compresses the prompt from its observation window (its decode-time eviction, each "
        "layer at its prefill budget, is not reproduced)"
    )
    unsupported_stages: tuple[str, ...] = ("decode", "both")

    def __init__(self, window: int = 32, kernel_size: int = 5, gamma: float = 200.0):
        super().__init__(window=window, kernel_size=kernel_size, pooling="avg")
        if int(window) < 2:
            raise ValueError(f"cake window={window} must be >= 2 queries: the indicator's variance is over them")
        if not float(gamma) >= 0.0:
            raise ValueError(f"cake gamma={gamma} must be >= 0 (the weight of the attention's variance)")
        self.gamma = float(gamma)

    def __call__(self, state: TokenState) -> torch.Tensor:
        rows = state.stats["qlog"]  # [H, W, n]
        mean = logged_sum(state) / rows.shape[1]
        var = (rows - mean.unsqueeze(1)).square().sum(dim=1) / max(rows.shape[1] - 1, 1)
        return pool_neighbours(mean + self.gamma * var, self.kernel_size, "avg", self.in_window(state))
