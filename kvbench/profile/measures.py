"""What one block of attention probabilities says about a layer: pure functions on ``[heads, queries, keys]``.

Every function takes probabilities already reduced to KV heads (the mean over a GQA group's query heads, as the
engine reduces them for the policies' statistics), keys the queries could not see holding 0. They return one
value per (head, query) so that a caller can sum them over blocks of queries and never hold the n×n matrix.
"""

from __future__ import annotations

import torch

N_SINK = 4
N_RECENT = 64
COVERAGE_LEVELS = (0.9, 0.95)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each query's distribution, [H, q] (0 · log 0 = 0)."""
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return -(probs * logs).sum(dim=-1)


def mass_on(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The mass each query puts on the keys ``keys`` selects (bool [q, n] or [n]), [H, q]."""
    return (probs * keys.to(probs.dtype)).sum(dim=-1)


def sink_keys(key_positions: torch.Tensor, n_sink: int = N_SINK) -> torch.Tensor:
    """Bool [n]: the first ``n_sink`` tokens of the sequence (attention sinks)."""
    return key_positions < n_sink


def recent_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, n_recent: int = N_RECENT) -> torch.Tensor:
    """Bool [q, n]: the ``n_recent`` newest tokens each query sees, itself included."""
    age = query_positions.unsqueeze(-1) - key_positions.unsqueeze(0)
    return (age >= 0) & (age < n_recent)


def coverage_fraction(probs: torch.Tensor, visible: torch.Tensor, level: float) -> torch.Tensor:
    """The fraction of the keys a query sees that it needs, taken from its largest probability down, to cover
    ``level`` of its mass, [H, q]. ``visible``: keys seen per query, [q] or [H, q]."""
    ranked = probs.sort(dim=-1, descending=True).values
    covered = ranked.cumsum(dim=-1)
    total = covered[..., -1:]
    needed = (covered < level * total - 1e-6).sum(dim=-1) + 1
    return needed.to(probs.dtype) / visible.to(probs.dtype).clamp_min(1.0)


def age_moments(
    probs: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor, max_age: int
) -> torch.Tensor:
    """Per head and age (query position - key position, below ``max_age``): the count, sum and sum of squares of
    the probabilities tokens of that age received, [3, H, max_age]. Their moments give RoCo's robustness curve:
    the spread of the attention a token receives as it ages. ``visible``: bool [q, n] or [H, q, n]."""
    heads = probs.shape[0]
    age = query_positions.unsqueeze(-1) - key_positions.unsqueeze(0)
    keep = (visible & (age < max_age)).expand(probs.shape)
    slot = (torch.arange(heads, device=probs.device).view(-1, 1, 1) * max_age + age.clamp(0, max_age - 1)).expand(
        probs.shape
    )[keep]
    values = probs[keep].to(torch.float64)
    size = heads * max_age
    out = torch.stack(
        [
            torch.bincount(slot, minlength=size).to(torch.float64),
            torch.bincount(slot, weights=values, minlength=size),
            torch.bincount(slot, weights=values.square(), minlength=size),
        ]
    )
    return out.view(3, heads, max_age)


def std_from_moments(moments: torch.Tensor) -> torch.Tensor:
    """Population standard deviation from ``age_moments`` (summed over blocks); NaN where no token had that age."""
    count, total, squares = moments.unbind(0)
    mean = total / count
    return (squares / count - mean.square()).clamp_min(0.0).sqrt()


def attention_recall(future_mass: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The share of the future attention mass on the prompt [H, n] that falls on the kept set (bool [H, n]), per
    head [H]: sums over the future queries first, then the ratio, so the oracle top-B is the best any B keys do."""
    total = future_mass.sum(dim=-1)
    on_kept = (future_mass * kept.to(future_mass.dtype)).sum(dim=-1)
    return torch.where(total > 0, on_kept / total.clamp_min(1e-30), torch.ones_like(total))


def top_budget(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Bool [H, n]: each head's ``budget`` highest scores (all of them when ``budget`` >= n)."""
    k = min(budget, scores.shape[-1])
    index = torch.topk(scores, k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)


def oracle_recall(future_mass: torch.Tensor, budget: int) -> torch.Tensor:
    """The best recall any ``budget`` keys per head reach: the top-B of the future mass itself, [H]."""
    return attention_recall(future_mass, top_budget(future_mass, budget))
