"""What one block of attention probabilities says about a layer: pure functions on ``[heads, queries, keys]``.

Every function takes probabilities already reduced to KV heads (the mean over a GQA group's query heads, as the
engine reduces them for the policies' statistics), keys the queries could not see holding 0. They return one
value per (head, query) so that a caller can sum them over blocks of queries and never hold the n×n matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

N_SINK = 4
N_RECENT = 64
COVERAGE_LEVELS = (0.9, 0.95)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each query's distribution, [H, q] (0 · log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def mass_on(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The mass each query puts on the keys ``keys`` selects (bool [q, n] or [n]), [H, q]."""
    return (probs * keys.to(probs.dtype)).sum(dim=-1)


def sink_keys(key_positions: torch.Tensor, n_sink: int = N_SINK) -> torch.Tensor:
    """Bool [n]: the first ``n_sink`` tokens of the sequence (attention sinks)."""
    return key_positions < n_sink


def coverage_fractions(probs: torch.Tensor, visible: torch.Tensor, levels: Sequence[float]) -> torch.Tensor:
    """Per level, the fraction of the keys a query sees that it needs, taken from its largest probability down,
    to cover that share of its mass, [levels, H, q]. ``visible``: keys seen per query, [q] or [H, q]."""
    covered = probs.sort(dim=-1, descending=True).values.cumsum_(dim=-1)  # ascending along each row
    total = covered[..., -1:]
    seen = visible.to(probs.dtype).clamp_min(1.0)
    out = []
    for level in levels:  # keys before the first running sum that reaches the level, plus that one
        needed = torch.searchsorted(covered, (level * total - 1e-6).contiguous()).squeeze(-1) + 1
        out.append(needed.clamp_max(covered.shape[-1]).to(probs.dtype) / seen)
    return torch.stack(out)


def by_age(
    probs: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor, ages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's probabilities by the age of the key (query position - key position, 0 to ``ages`` - 1),
    [H, q, ages], and whether the query saw a key of that age, bool [q, ages]. Keys are consecutive positions
    from ``key_positions[0]``; ``visible`` bool [q, n]."""
    first = int(key_positions[0])
    index = query_positions.unsqueeze(-1) - first - torch.arange(ages, device=probs.device)  # [q, ages]
    inside = (index >= 0) & (index < probs.shape[-1])
    index = index.clamp(0, probs.shape[-1] - 1)
    seen = visible.gather(-1, index) & inside
    values = probs.gather(-1, index.expand(probs.shape[0], -1, -1)) * seen
    return values, seen


def recent_mass(values_by_age: torch.Tensor, n_recent: int = N_RECENT) -> torch.Tensor:
    """The mass each query puts on its ``n_recent`` newest keys, itself included, [H, q] (from ``by_age``)."""
    return values_by_age[..., :n_recent].sum(dim=-1)


def age_moments(values_by_age: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Per head and age: the count, sum and sum of squares of the probabilities tokens of that age received,
    [3, H, ages] (from ``by_age``). Their moments give RoCo's robustness curve: the spread of the attention a
    token receives as it ages."""
    ones = torch.ones(1, values_by_age.shape[1], dtype=values_by_age.dtype, device=values_by_age.device)
    count = (ones @ seen.to(values_by_age.dtype)).to(torch.float64).expand(values_by_age.shape[0], -1)
    # sums over queries as products with a row of ones: much faster on CPU than a reduction over a middle axis
    total = (ones @ values_by_age).squeeze(1).to(torch.float64)
    squares = (ones @ values_by_age.square()).squeeze(1).to(torch.float64)
    return torch.stack([count, total, squares])


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
