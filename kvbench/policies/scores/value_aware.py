"""VATP: value-aware token pruning."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbench.policies.base import ScoreWrapper
from kvbench.policies.parts import SCORES, register_score
from kvbench.policies.state import TokenState


@register_score("value_aware")
class ValueAware(ScoreWrapper):
    """Attention × value norm. ``base`` is an attention score (accumulated by default), multiplied by the
    ``p``-norm of the token's value vector (VATP uses the L1 norm), taken once when the value is written."""

    def __init__(self, base: str = "accumulated", p: float = 1.0):
        if base not in SCORES or base == "value_aware":
            others = sorted(set(SCORES.names()) - {"value_aware"})
            raise ValueError(f"value_aware base {base!r} must be another score: {others}")
        super().__init__(SCORES.get(base)())
        self.p = float(p)
        self.feature_names = self.feature_names | {"value_norm"}

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return super().features(keys, values, weights) | {"value_norm": values.to(torch.float32).norm(p=self.p, dim=-1)}

    def __call__(self, state: TokenState) -> torch.Tensor:
        return self.inner(state) * state.stats["value_norm"]
