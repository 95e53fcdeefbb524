"""K-norm (Devoto et al.): a free score, no attention needed."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("key_norm")
class KeyNorm(Score):
    """Keys with a LOWER L2 norm are kept (low key norm goes with high attention). RoPE is a rotation, so the norm
    of a rotated key is the norm of the raw key; it is taken once, when the key is written."""

    feature_names = frozenset({"key_norm"})

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {"key_norm": keys.to(torch.float32).norm(dim=-1)}

    def __call__(self, state: TokenState) -> torch.Tensor:
        return -state.stats["key_norm"]
