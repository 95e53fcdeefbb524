"""Compactor's non-causal chunked attention, times the value norm (kvpress's NonCausalAttnPress)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.blocks import by_row_blocks
from kvbench.policies.inputs import EVERY, Queries
from kvbench.policies.parts import register_score
from kvbench.policies.scores.snapkv import pool_neighbours
from kvbench.policies.state import TokenState
from kvbench.policies.zscore import unit_zscore


@register_score("noncausal_attn")
class NonCausalAttention(Score):
    """Non-causal chunked attention: the prompt is cut into chunks of ``chunk_size`` tokens, every query of a
    chunk attends every key of the chunk (later ones too), and a token scores the attention its chunk's queries
    paid it, summed over them and averaged over its KV head's GQA group, times its value's L2 norm, averaged with
    its two neighbours (zero beyond the ends) and z-scored over the layer's heads (Chari & Van Durme 2025).

    As kvpress's NonCausalAttnPress, which the paper's authors wrote: the logits are qᵀk without the 1/√D scale
    (nor a family's softcap), and the last chunk is filled up to ``chunk_size`` with zero queries and zero keys,
    whose logits are 0 (kvpress's mask of them is −1e−9, the same in float32), so they take part in its softmax.

    Every prompt query is read, so the rule scores the prompt fed in one step: decode and ``both`` are refused,
    and so is a prefill ``stride``. The chunks are scored a few rows at a time (``policies.blocks``), never the
    whole [length × length] matrix."""

    queries = Queries(last=EVERY, rope=True)
    rope = True  # for the keys as the prompt's attention saw them, under any positions mode
    whole_prompt = True
    unsupported_stages = ("decode", "both")
    why_unsupported = "non-causal attention needs every prompt query, so it compresses the prompt only"

    def __init__(self, chunk_size: int = 256):
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        self.chunk_size = int(chunk_size)

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = noncausal_scores(prompt_queries(view), view.keys_after_rope, view.values, self.chunk_size)
        return unit_zscore(scores, None, view.units)


def noncausal_scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: int) -> torch.Tensor:
    """Chunked non-causal attention received [r, n] times the value norm, pooled over 3 neighbours: queries
    [r, group, n, D] as attention saw them, keys and values [r, n, D]."""
    r, group, n, dim = queries.shape
    padded = n + (-n % chunk)
    received = by_row_blocks(
        lambda q, k: chunked_attention(q, k, chunk), (queries, keys), per_row=group * padded * chunk
    )
    return pool_neighbours(received * values.to(torch.float32).norm(dim=-1), 3, "avg")


def chunked_attention(queries: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """The attention each key received from its chunk's queries, summed, GQA group mean: [r, n]."""
    r, group, n, dim = queries.shape
    fill = -n % chunk
    chunks = (n + fill) // chunk
    q = F.pad(queries.to(torch.float32), (0, 0, 0, fill)).view(r, group, chunks, chunk, dim)
    k = F.pad(keys.to(torch.float32), (0, 0, 0, fill)).view(r * chunks, chunk, dim)
    q = q.transpose(1, 2).reshape(r * chunks, group * chunk, dim)  # a chunk's queries of every head together
    probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)  # [r × chunks, group × chunk, chunk]
    return probs.view(r, chunks, group * chunk, chunk).sum(dim=2).reshape(r, -1)[:, :n] / group


def prompt_queries(view: TokenState) -> torch.Tensor:
    """The view's queries, one per held entry: [r, group, n, D]. They are the prompt's, fed in one step and
    evicted from once (``Score.whole_prompt``); anything else is a layout such a rule cannot read."""
    queries = view.queries
    padded = view.valid is not None and not bool(view.valid.all())
    if queries is None or queries.shape[2] != view.length or padded:
        raise ValueError(
            "this score reads one query per held entry: the prompt fed in one step (stride=null), evicted once"
        )
    return queries
