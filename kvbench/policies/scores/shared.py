"""``shared: true`` on any score: one kept set per layer (TOVA's layer-wise choice). A wrapper, not a kind."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.state import TokenState


class SharedAcrossHeads(Score):
    """The inner score averaged over the layer's KV heads. Needs heads sharing one length (uniform allocation)."""

    def __init__(self, inner: Score):
        self.inner = inner
        self.needs = inner.needs
        self.history = inner.history
        self.unsupported_stages = inner.unsupported_stages
        self.why_unsupported = inner.why_unsupported
        self.feature_names = inner.feature_names

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.features(keys, values)

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        return self.inner.log_rows(probs, nvis)

    def __call__(self, state: TokenState) -> torch.Tensor:
        if state.valid is not None:
            raise ValueError("shared: true needs heads holding the same tokens; it cannot run with per-head allocation")
        scores = self.inner(state).to(torch.float32)
        per_layer = scores.reshape(state.units, -1, scores.shape[-1])  # each (layer, sequence) chooses its own
        return per_layer.mean(dim=1, keepdim=True).expand_as(per_layer).reshape(scores.shape)
