"""KVCompose's token score: the attention a second pass of the prompt pays the first (kvpress's KVComposePress)."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.blocks import BLOCK_ELEMENTS, by_row_blocks
from kvbench.policies.inputs import EVERY, Queries
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("kvcompose")
class KVComposeScore(Score):
    """KVCompose (Akulov et al. 2025): the prompt is fed a second time after itself (``Score.rereads``); a token
    of the first pass scores the most attention any query of the second pass paid it, per query head (the
    model's own probabilities, over every key the query saw, both passes'), averaged over its KV head's GQA
    group; with ``mean_across_heads`` the mean of that over the layer's KV heads is added (kvpress's
    ``add_mean_across_heads``, its default). The second pass's own entries score -inf: its eviction drops them
    all. Paired with ``allocation=composite``, which gives each layer its count (kvpress's structured variant).

    Every query of the second pass is read, so the prompt is scored whole: decode and ``both`` are refused, and
    so is a prefill ``stride``. Queries are scored a block at a time, never the whole [length × 2 length]."""

    queries = Queries(last=EVERY, rope=True, scaled=True)
    rope = True  # the keys as attention saw them, whatever the positions mode stores
    rereads = True
    unsupported_stages = ("decode", "both")
    why_unsupported = "KVCompose scores a prompt by the attention of a second pass of it, so it compresses prompts only"

    def __init__(self, mean_across_heads: bool = True):
        self.mean_across_heads = bool(mean_across_heads)

    def __call__(self, view: TokenState) -> torch.Tensor:
        queries = view.queries
        k = 0 if queries is None else queries.shape[2]
        padded = view.valid is not None and not bool(view.valid.all())
        if queries is None or padded or view.length != 2 * k:
            raise ValueError("kvcompose reads a prompt fed twice in one cache (stride=null, stage=prefill)")
        received = reread_attention(queries, view.keys_after_rope, view.positions)  # [r, k]
        if self.mean_across_heads:
            units = view.per_unit(received)
            received = (units + units.mean(dim=1, keepdim=True)).reshape(received.shape)
        by_entry = received.gather(1, view.positions.clamp(0, k - 1))
        return by_entry.masked_fill(view.positions >= k, float("-inf"))


def reread_attention(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per row, the most probability any second-pass query gave each first-pass key, GQA group mean: [r, k].
    queries [r, group, k, D] (scaled, at positions k..2k-1), keys [r, 2k, D] as attention saw them, positions
    [r, 2k] (each row's first-pass entries are those below k)."""
    r, group, k, _ = queries.shape
    order = positions.argsort(dim=1)
    keys = keys.gather(1, order.unsqueeze(-1).expand_as(keys))
    per_row = group * min(k, 256) * 2 * k
    return by_row_blocks(lambda q, key: _most_received(q, key), (queries, keys), per_row)


def _most_received(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``reread_attention`` on a block of rows whose keys are in position order (0..2k-1)."""
    r, group, k, _ = queries.shape
    block = max(1, BLOCK_ELEMENTS // max(1, r * group * 2 * k))
    best = torch.zeros(r, group, k, device=queries.device)
    key_index = torch.arange(2 * k, device=queries.device)
    keys = keys.to(torch.float32).transpose(1, 2).unsqueeze(1)  # [r, 1, D, 2k]
    for start in range(0, k, block):
        q = queries[:, :, start : start + block].to(torch.float32)
        logits = torch.matmul(q, keys)  # [r, group, b, 2k]
        seen = key_index <= (k + start + torch.arange(q.shape[2], device=q.device)).unsqueeze(1)  # [b, 2k]
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)[..., :k]
        best = torch.maximum(best, probs.amax(dim=2))
    return best.mean(dim=1)
