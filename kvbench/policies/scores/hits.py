"""ScissorHands' persistence of importance."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.derived import logged_sum
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("hits")
class Hits(Score):
    """A hit count over a history window.

    Let the layer's query log hold the last ``history`` queries it processed (one query per fed token,
    prefill and decode alike, oldest dropped first). Query i *hits* held token j when j was visible to i
    and the (GQA group-mean) attention probability a_ij >= threshold / n_i, where n_i is the number of
    entries query i could see: ``threshold = 1`` means "at least the uniform share", ScissorHands' average
    attention 1/t. The score of j is its number of hits; tokens that keep being important have the most.
    The log keeps each query's hit indicators (``log_rows``), decided once when the query is logged.
    (ScissorHands counts the complementary "below average" events and evicts the largest counts; counting
    hits differs only for tokens younger than the window, which scopes protect as its recent window.)
    """

    needs = frozenset({"qlog"})

    def __init__(self, history: int = 32, threshold: float = 1.0):
        if int(history) < 1:
            raise ValueError(f"history={history} must be >= 1 query")
        if float(threshold) <= 0:
            raise ValueError(f"threshold={threshold} must be > 0 (a multiple of the uniform share 1/n)")
        self.history = int(history)
        self.threshold = float(threshold)

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        bar = self.threshold / nvis.clamp_min(1.0)  # > 0, so a key a query did not see (0) never hits
        return (probs >= bar.unsqueeze(-1)).to(torch.float32)

    def __call__(self, state: TokenState) -> torch.Tensor:
        return logged_sum(state)
