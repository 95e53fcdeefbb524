"""ChunkKV (Liu et al. 2025): keep whole chunks of consecutive tokens, not scattered ones."""

from __future__ import annotations

import torch

from kvbench.policies.base import ScoreWrapper
from kvbench.policies.grouped import lexicographic, places
from kvbench.policies.parts import register_score
from kvbench.policies.registry import build_score
from kvbench.policies.state import TokenState


@register_score("chunkkv")
class ChunkKV(ScoreWrapper):
    """ChunkKV: positions fall into chunks of ``chunk`` consecutive tokens; a chunk's score is the mean of the
    ``base`` score over the entries it holds (the paper's sum over a whole chunk, and kvpress's mean, which also
    ranks a short last chunk fairly), and whole chunks are kept, best chunk first. ``base`` is any score, a kind
    or ``{kind: ..., options}``; with ``shared: true`` in it the chunks are ranked by the layer's heads together
    (kvpress sums the base score over the heads: one kept set per layer).

    The score is each entry's place in that order, so the budget keeps whole chunks: by chunk, then, within the
    chunk the budget cuts, by the base score. kvpress keeps whole chunks only, ⌊chunks × (1 − compression_ratio)⌋
    of them; kvbench keeps exactly the budget, so the last chunk may be kept in part. What the scope protects
    (SnapKV's observation window, configs/policy/chunkkv.yaml) is kept first; kvpress instead gives the window
    entries a score above every other, which lifts the chunk the window starts in.

    ``whole_chunks: true`` marks kvpress's choice in the scores, the order unchanged: a row of n entries in C
    chunks under a budget B keeps max(1, ⌊C × B / n⌋) chunks (kvpress's ⌊C × (1 − compression_ratio)⌋ for
    B = n × (1 − ratio)), whose entries score above 0 and the others below. The threshold allocation at 0 then
    keeps those chunks only (configs/policy/chunkkv_kvpress.yaml); the budget still caps a row."""

    def __init__(self, base: str | dict = "snapkv", chunk: int = 20, whole_chunks: bool = False):
        if int(chunk) < 1:
            raise ValueError(f"chunkkv chunk={chunk} must be at least 1 token")
        super().__init__(build_score(base))
        self.chunk = int(chunk)
        self.whole_chunks = bool(whole_chunks)

    def __call__(self, state: TokenState) -> torch.Tensor:
        scores = self.inner(state).to(torch.float32)
        valid = state.valid_mask()
        outside = state.outside_window()  # a sliding layer's entries its next query cannot see: in no chunk
        if outside is not None:
            valid = valid & ~outside
        slots = int(state.positions.max()) // self.chunk + 1  # one more: padding
        chunk = torch.where(valid, state.positions // self.chunk, slots)
        total = torch.zeros(scores.shape[0], slots + 1, device=scores.device)
        counts = torch.zeros_like(total).scatter_add_(1, chunk, valid.to(torch.float32))
        mean = total.scatter_add_(1, chunk, scores.masked_fill(~valid, 0.0)) / counts.clamp_min(1)
        mean = mean.masked_fill(counts == 0, float("-inf"))  # chunks holding nothing (and the padding slot) last
        rank = places(torch.sort(-mean, dim=-1, stable=True).indices)  # 0: the best chunk (ties: the earlier)
        order = lexicographic(rank.gather(1, chunk), -scores.masked_fill(~valid, float("inf")))
        place = -places(order).to(torch.float32)
        if not self.whole_chunks or state.budget is None:
            return place
        held = counts[:, :slots].gt(0).sum(dim=1)  # chunks holding an entry, per row
        kept = (held * state.budget).div(valid.sum(dim=1).clamp_min(1), rounding_mode="floor").clamp(1, None)
        chosen = rank.gather(1, chunk) < kept.unsqueeze(1)
        return torch.where(chosen, place + state.length + 1, place - 1)  # the chosen above 0, the order kept
