"""DuoAttention's retrieval and streaming heads (Xiao et al. 2024, arXiv:2410.10819), the split estimated from the
prompt itself as kvpress's on-the-fly scoring estimates it, not learned."""

from __future__ import annotations

import math

import torch

from kvbench.policies.base import Score
from kvbench.policies.inputs import EVERY, Queries
from kvbench.policies.parts import register_score
from kvbench.policies.scores.noncausal_attn import prompt_queries
from kvbench.policies.state import TokenState


@register_score("duoattention")
class DuoAttention(Score):
    """Each KV head of the sequence gets a score: its layer's mean prompt query (before RoPE) rotated to position
    ``length - 1`` attends ``length`` copies of the mean prompt key rotated to positions ``0 … length - 1``, and the
    score is the area under that attention's cumulative sum (the mean of the cumulative sum), averaged over the
    head's GQA group. A head whose attention piles up on the newest copies scores low: the ``head_ratio`` share
    of the sequence's heads that score lowest, ranked over every layer at once, are streaming heads and keep
    their first ``n_sink`` and newest ``n_recent`` entries; the others are retrieval heads and keep everything.

    The score says what each row keeps, for the threshold allocation at 0 pooling the sequence's layers
    (configs/policy/duoattention.yaml): +inf on the sinks and the recent window, -inf on a streaming head's
    other entries, 0 on a retrieval head's (ranked newest first only where the budget caps a row). Every prompt
    query is read, so the prompt is fed in one step and compressed once."""

    queries = Queries(last=EVERY, rope=False)
    rope = True
    whole_prompt = True
    unsupported_stages = ("decode", "both")
    why_unsupported = "DuoAttention's head split is estimated from every prompt query, so it compresses the prompt"

    def __init__(self, head_ratio: float = 0.5, n_sink: int = 128, n_recent: int = 256, length: int = 500):
        if not 0.0 <= float(head_ratio) <= 1.0:
            raise ValueError(f"head_ratio={head_ratio} must be in [0, 1] (the share of KV heads made streaming)")
        if min(int(n_sink), int(n_recent)) < 0:
            raise ValueError(f"n_sink={n_sink} and n_recent={n_recent} must be >= 0 entries")
        if int(length) < 1:
            raise ValueError(f"length={length} must be >= 1 position")
        self.head_ratio = float(head_ratio)
        self.n_sink, self.n_recent, self.length = int(n_sink), int(n_recent), int(length)

    def head_scores(self, view: TokenState) -> torch.Tensor:
        """Float [rows]: each KV head's area under the cumulative attention of its mean query on its mean key."""
        query = prompt_queries(view).to(torch.float32).mean(dim=2)  # [r, group, D]
        key = view.keys_before_rope.to(torch.float32).mean(dim=1)  # [r, D]
        rows, group, dim = query.shape
        rope = view.rope
        assert rope is not None, "the score declares rope = True"
        where = torch.arange(self.length, device=query.device).expand(rows, -1)
        keys = rope.rotate(key.unsqueeze(1).expand(-1, self.length, -1), where)  # [r, length, D]
        last = where[:, -1:].unsqueeze(1).expand(-1, group, -1)
        queries = rope.rotate(query.unsqueeze(2), last).squeeze(2)  # [r, group, D]
        attention = (torch.einsum("rgd,rnd->rgn", queries, keys) / math.sqrt(dim)).softmax(dim=-1)
        return attention.cumsum(dim=-1).mean(dim=-1).mean(dim=-1)

    def streaming(self, view: TokenState) -> torch.Tensor:
        """Bool [rows]: the ``round(rows × head_ratio)`` lowest-scoring heads of the view (ties: the earlier row)."""
        scores = self.head_scores(view)
        count = round(scores.shape[0] * self.head_ratio)
        out = torch.zeros_like(scores, dtype=torch.bool)
        out[torch.argsort(scores, stable=True)[:count]] = True
        return out

    def __call__(self, view: TokenState) -> torch.Tensor:
        index = torch.arange(view.length, device=view.positions.device)
        lengths = view.lengths().unsqueeze(1)
        kept = (index < self.n_sink) | (index >= lengths - self.n_recent)
        scores = torch.zeros(view.heads, view.length, device=view.positions.device)
        dropped = self.streaming(view).unsqueeze(1) & ~kept
        return scores.masked_fill(kept, float("inf")).masked_fill(dropped, float("-inf"))
