"""RoCo's mean attention."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.derived import mean_attention
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("mean")
class Mean(Score):
    """Accumulated attention divided by the number of queries that attended the token, so old tokens are not
    favoured just for having been seen by more queries."""

    needs = frozenset({"acc", "count"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return mean_attention(state)
