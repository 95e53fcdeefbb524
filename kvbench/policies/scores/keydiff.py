"""KeyDiff (Park et al. 2025): a key unlike the others is one attention tends to pick out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.running import RowSum
from kvbench.policies.state import TokenState


def unit_keys(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each entry's key direction, summed per row by the cache (the row's anchor is their mean)."""
    return F.normalize(keys.float(), dim=-1)


@register_score("keydiff")
class KeyDiff(Score):
    """KeyDiff: minus the cosine similarity of each held key to the row's anchor, the mean of its normalised keys,
    so the keys most like the anchor go first. Attention-free, as in the paper and kvpress's KeyDiffPress (the
    key as the cache holds it, after RoPE). The anchor is the running sum the cache keeps (``RowSum``), so a decode
    step reads it instead of normalising every held key again.

    The paper runs it block-wise: the prompt is fed ``block_size`` tokens at a time and the cache is evicted back
    to the budget after each block. That is kvbench's chunked prefill: ``stride=<block_size>`` with
    ``stage=prefill`` (or ``both``), a true one, where each block attends to the compressed cache, as the paper's
    device does. kvpress's BlockPress simulates it on keys computed from the whole prompt, and starts its blocks
    after the first ``budget`` tokens rather than at 0: both sides score the same sets in the first layer when the
    budget is a multiple of the block size (tests/policies/test_keydiff.py)."""

    row_sums = (RowSum("key_direction", unit_keys),)

    def __call__(self, state: TokenState) -> torch.Tensor:
        anchor = state.row_sums["key_direction"] / state.lengths().clamp_min(1).unsqueeze(1)
        return -F.cosine_similarity(state.keys.float(), anchor.to(torch.float32).unsqueeze(1), dim=-1)
