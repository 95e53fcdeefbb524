"""Finch's prompt-guided scores (Corallo & Papotti 2024): the question's attention over the context."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("finch")
class Finch(Score):
    """Finch (kvpress's FinchPress): SnapKV's scores with the question as the observation window. The engine
    compresses the context with its question (the suffix a task feeds apart, ``question_aware=false``) and tells
    the score how many of the prompt's last tokens are the question (``TokenState.observe``); each query of it
    weighs its attention by its position p (the keys before it: kvpress's normalisation, so that a later query,
    its attention spread over more keys, counts as much as an earlier one) and an entry before the question
    scores the mean over the question's queries of that weighted attention (its KV head's: the GQA group's mean,
    as kvpress). No pooling. The question's own entries score above every other entry of the layer, as kvpress's
    (the layer's best plus one), so the budget keeps them; a budget below the question's length keeps part of it,
    picked among equal scores (kvpress's top-k too). Each head keeps its own set (uniform allocation); the kept
    keys are re-rotated to contiguous positions by the config's ``positions: reindex``.

    The query log holds the question's queries: the cache sizes it to the longest question it holds."""

    needs = frozenset({"qlog", "count"})
    question = True
    whole_prompt = True  # one eviction, at the prompt's end: a chunk before it would observe no question
    unsupported_stages: tuple[str, ...] = ("decode", "both")
    why_unsupported = "Finch compresses the prompt once, guided by its question; it does not evict while decoding"

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        """Each query's attention times its position, the keys before it (``nvis - 1`` on the prompt)."""
        return probs * (nvis - 1).clamp_min(0).unsqueeze(-1)

    def __call__(self, state: TokenState) -> torch.Tensor:
        if not state.observe:
            raise ValueError("finch scores a prompt from its question, and the engine gave it none")
        rows = state.stats["qlog"]  # [H, W, n], query p at ring place p % W
        newest = state.positions.masked_fill(~state.valid_mask(), -1).amax(dim=1, keepdim=True)
        asked = newest + torch.arange(1 - state.observe, 1, device=rows.device)  # the question's positions [H, q]
        logged = rows.gather(1, (asked % rows.shape[1]).unsqueeze(-1).expand(-1, -1, rows.shape[2]))
        scores = logged.sum(dim=1) / state.observe
        count = state.stats["count"]
        question = (count <= state.observe) & state.valid_mask()
        before = scores.masked_fill(question | ~state.valid_mask(), float("-inf"))
        best = state.per_unit(before).flatten(1).amax(dim=1).nan_to_num(neginf=0.0) + 1.0
        top = best.repeat_interleave(state.heads // state.units).unsqueeze(1).expand_as(scores)
        return torch.where(question, top, scores)
