"""SimLayerKV's lazy layers (Zhang et al. 2024, arXiv:2410.13846): a layer whose last queries look almost only at
the attention sinks and the recent window keeps only those; the other layers keep everything."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("simlayerkv")
class SimLayerKV(Score):
    """Per (layer, sequence): the attention of the last ``n_last`` queries (their mean, and the mean over the
    layer's query heads) on the first ``n_initial`` positions and on the ``n_recent`` entries before those
    queries' own is the layer's *concentration*; the layer is lazy when it exceeds ``lazy_threshold``. A lazy
    layer keeps the sinks and its newest ``n_recent - n_last`` entries (kvpress's SimLayerKVPress keeps that many;
    its concentration leaves the last ``n_last`` entries out); a layer is never lazy while its rows hold at most
    ``n_initial + n_recent + n_last`` entries, as in kvpress.

    The score says what the layer keeps, for the threshold allocation at 0 (configs/policy/simlayerkv.yaml):
    +inf on the sinks and the kept window, -inf on the other entries of a lazy layer, and elsewhere the head-mean
    attention of the last queries, which ranks a non-lazy layer's entries only where the budget caps it. Every
    head of a layer keeps the same set. It compresses a prompt: a decode step would decide again at every token.
    """

    needs = frozenset({"qlog", "count"})
    unsupported_stages = ("decode", "both")
    why_unsupported = "SimLayerKV decides once per layer, from the prompt's last queries, what the prompt's cache keeps"
    shares_heads = True

    def __init__(self, lazy_threshold: float = 0.9, n_initial: int = 4, n_recent: int = 1024, n_last: int = 1):
        if not 0.0 < float(lazy_threshold) <= 1.0:
            raise ValueError(f"lazy_threshold={lazy_threshold} must be in (0, 1] (a share of the attention)")
        if int(n_initial) < 0:
            raise ValueError(f"n_initial={n_initial} must be >= 0 sink tokens")
        if int(n_last) < 1:
            raise ValueError(f"n_last={n_last} must be >= 1 query")
        if int(n_recent) < int(n_last):
            raise ValueError(f"n_recent={n_recent} must be >= n_last={n_last} (a lazy layer keeps n_recent - n_last)")
        self.lazy_threshold = float(lazy_threshold)
        self.n_initial, self.n_recent, self.n_last = int(n_initial), int(n_recent), int(n_last)
        self.history = self.n_last

    def lazy(self, state: TokenState, attention: torch.Tensor) -> torch.Tensor:
        """Bool [units]: which (layer, sequence) units are lazy, from the last queries' attention [H, n]."""
        count = state.stats["count"]  # tokens fed since the entry, itself included
        sinks = state.positions < self.n_initial
        recent = (count > self.n_last) & (count <= self.n_last + self.n_recent)
        measured = (sinks | recent) & state.valid_mask()
        concentration = state.per_unit(attention * measured).sum(dim=-1).mean(dim=-1)
        long = state.per_unit(state.lengths()).amax(dim=-1) > self.n_initial + self.n_recent + self.n_last
        return long & (concentration > self.lazy_threshold)

    def __call__(self, state: TokenState) -> torch.Tensor:
        attention = state.stats["qlog"].sum(dim=1) / self.n_last  # [H, n]: the last queries' mean
        lazy = self.lazy(state, attention)
        per_unit = state.per_unit(attention)
        shared = per_unit.mean(dim=1, keepdim=True).expand_as(per_unit).reshape(attention.shape)
        kept = (state.positions < self.n_initial) | (state.stats["count"] <= self.n_recent - self.n_last)
        dropped = lazy.repeat_interleave(state.heads // state.units).unsqueeze(1) & ~kept
        return shared.masked_fill(kept, float("inf")).masked_fill(dropped, float("-inf"))
