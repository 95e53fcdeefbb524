"""Oracle consistency: how much of the continuation's attention on the prompt falls on the set a score (or a full
policy) would keep at the end of the prompt, against the best set of the same size.

The kept set is the policy's own: its score, scope and allocation run on a ``TokenState`` built from the engine's
statistics over the prompt (a prompt encoded in one chunk, nothing evicted before its end), exactly the state a
``stage=prefill`` run evicts from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbench.budget import budget_tokens
from kvbench.engine.score_inputs import per_head
from kvbench.policies.parts import SCORES
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import FromPositions, declared, stored_names
from kvbench.profile.collect import PromptEnd
from kvbench.profile.measures import attention_recall, oracle_recall

ORACLE = "oracle"


def bare_scores(kinds: Sequence[str] | None = None) -> dict[str, Policy]:
    """One policy per score kind (every registered score it can measure by default), alone: nothing protected and
    every layer at the budget, so what is measured is the consistency of the score itself."""
    kinds = measurable_scores() if kinds is None else kinds
    return {kind: build_policy({"name": kind, "score": kind, "scope": "all"}) for kind in kinds}


def unmeasurable(policy: Policy) -> str | None:
    """Why the profile cannot build the state this policy's score reads (None: it can). The profile records the
    prompt's keys, values and statistics, not the evicting step's queries nor the model's RoPE."""
    if policy.queries is not None:
        return "it reads the evicting step's queries, which profiling does not record"
    if policy.rope:
        return "it reads the model's RoPE, which profiling does not record"
    if policy.replay is not None:
        return "it reads the attention of replay passes after the prompt, which profiling does not run"
    if policy.question:
        return "it reads the attention of the prompt's question, which profiling does not set apart"
    return None


def measurable_scores() -> list[str]:
    """The registered scores the profile can measure (``scores: all``)."""
    return [k for k in SCORES.names() if unmeasurable(build_policy({"name": k, "score": k, "scope": "all"})) is None]


@dataclass
class Budgets:
    """Per candidate, per budget, each layer's token budget (None: the layer is left alone by the policy)."""

    asked: list[float | int]
    tokens: list[int]
    per_layer: dict[str, list[list[int]]]


def layer_budgets(
    policies: Mapping[str, Policy], asked: Sequence[float | int], prompt: int, windows: Sequence[int | None]
) -> Budgets:
    """Each policy's split of each budget over the full-attention layers (a sliding layer gets the plain
    budget: the recall there is reported but not part of the averages)."""
    tokens = [budget_tokens(b, prompt) for b in asked]
    full = [i for i, w in enumerate(windows) if w is None] or list(range(len(windows)))
    per_layer: dict[str, list[list[int]]] = {}
    for name, policy in policies.items():
        rows = []
        for b in tokens:
            split = dict(zip(full, policy.layer_budgets(b, len(full), prompt)))
            rows.append([split.get(i, b) for i in range(len(windows))])
        per_layer[name] = rows
    return Budgets(list(asked), tokens, per_layer)


def prompt_state(end: PromptEnd, policy: Policy, layer: int, seed: int = 0) -> TokenState:
    """The layer's state at the end of the prompt as the policy's parts would read it."""
    heads, length = end.keys.shape[0], end.keys.shape[1]
    positions = torch.arange(length, device=end.keys.device).expand(heads, length)
    stats = {name: end.stats[name] for name in stored_names(end.stats)}  # every declared attention statistic
    for computed in declared(policy.needs, FromPositions):
        stats[computed.name] = computed.of(torch.full((heads, 1), length, device=positions.device), positions)
    history = policy.history
    if history:
        rows, nvis = end.stats["qlog"][:, -history:], end.stats["qlog_nvis"][:, -history:]
        stats["qlog"] = policy.score.log_rows(rows, nvis)
    why = unmeasurable(policy)
    if why:
        raise ValueError(f"policy {policy.name!r} cannot be profiled: {why}")
    weights = {name: w for name, w in end.weights.items() if name in policy.weights}
    for at, part in per_head(weights, torch.arange(heads, device=end.keys.device), heads):
        for name, value in policy.features(end.keys[at], end.values[at], part).items():
            stats.setdefault(name, value.new_zeros(heads, value.shape[-1]))[at] = value
    row_sums = {s.name: s.of(end.keys, end.values).to(torch.float64).sum(dim=1) for s in policy.row_sums}
    return TokenState(
        keys=end.keys,
        values=end.values,
        positions=positions,
        stats=stats,
        row_sums=row_sums,
        phase="prefill",
        window=end.window,
        seen=length,
        seed=seed,
        row_keys=(layer * heads + torch.arange(heads, device=end.keys.device)).unsqueeze(1),
    )


def layer_recall(
    layer: int, future: torch.Tensor, end: PromptEnd, policies: Mapping[str, Policy], budgets: Budgets, seed: int = 0
) -> dict[str, list[float]]:
    """Per candidate (and ``oracle``), the layer's recall at each budget, averaged over its KV heads."""
    future = future.to(torch.float32)
    out = {ORACLE: [float(oracle_recall(future, b).mean()) for b in budgets.tokens]}
    for name, policy in policies.items():
        state = prompt_state(end, policy, layer, seed)
        out[name] = [
            float(attention_recall(future, policy.keep_mask(state, split[layer])).mean())
            for split in budgets.per_layer[name]
        ]
    return out
