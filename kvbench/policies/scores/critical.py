"""CriticalKV: a base score's budget spent in two stages, the second weighted by the output each value makes."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvbench.policies.allocations.adaptive import extreme
from kvbench.policies.base import ScoreWrapper
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState

FEATURE = "projected_value_l1"
BLOCK = 1024  # entries projected at once


@register_score("criticalkv")
class CriticalKV(ScoreWrapper):
    """CriticalKV (Feng et al. 2025): an entry's attention alone misjudges what evicting it changes, since its
    value enters the output through W_o. Each row spends its budget B in two stages: its ⌊``first_stage_ratio``
    × B⌋ best entries by the ``base`` score (at least one), then the rest of B by (base + ``epsilon``) ×
    ‖W_o v‖₁, the L1 norm of the value projected through the output projection, averaged over the query heads of
    the KV head's GQA group (taken once, when the value is written).

    kvbench keeps the top of a score per row, so the stages are scores: the first stage's entries score +inf,
    which the budget always keeps, and the rest rank by the weighted score. The stages run on the policy's own
    ranking (``TokenState.ranked``: what the scope protects comes first, as kvpress's SnapKV puts its window at
    the top of the first stage) and within each row's budget as the allocation gives it from the base score
    (``TokenState.kept_by``): under Ada-KV's head-adaptive split (``criticalkv_adakv``) a head's budget comes
    from the base score, as kvpress's CriticalAdaKVPress does, and the second stage re-ranks inside it.
    kvpress's first-stage count is int(kept × ratio) of the unrounded kept share; kvbench's of the kept count.

    ``first_stage_min`` (a share of the policy's per-head budget, 0 by default): the first stage takes at least
    ⌊share × budget⌋ entries (at least one when the share is positive) in every row. kvpress's CriticalAdaKVPress
    lifts Ada-KV's safeguard (each head's ⌊α × kept⌋ best) above the first stage's ranking, so its first stage
    holds the safeguard as well; configs/policy/criticalkv_adakv.yaml sets it to the allocation's floor.
    """

    label = "CriticalKV"

    def __init__(
        self,
        base: str | dict = "snapkv",
        first_stage_ratio: float = 0.5,
        epsilon: float = 1e-4,
        first_stage_min: float = 0.0,
    ):
        from kvbench.policies.registry import build_score

        kind = base if isinstance(base, str) else base.get("kind")
        if kind == "criticalkv":
            raise ValueError("criticalkv base must be another score, not criticalkv itself")
        if not 0.0 <= float(first_stage_ratio) <= 1.0:
            raise ValueError(f"first_stage_ratio={first_stage_ratio} must be a share of the budget in [0, 1]")
        if float(epsilon) < 0:
            raise ValueError(f"epsilon={epsilon} must be >= 0")
        if not 0.0 <= float(first_stage_min) <= 1.0:
            raise ValueError(f"first_stage_min={first_stage_min} must be a share of the budget in [0, 1]")
        super().__init__(build_score(base))
        self.first_stage_ratio = float(first_stage_ratio)
        self.epsilon = float(epsilon)
        self.first_stage_min = float(first_stage_min)
        self.weights = self.weights | {"output_projection"}
        self.feature_names = self.feature_names | {FEATURE}

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return super().features(keys, values, weights) | {FEATURE: projected_value_l1(values, weights)}

    def __call__(self, view: TokenState) -> torch.Tensor:
        base = self.inner(view).to(torch.float32)
        budgets = view.kept_by(base).sum(dim=1)  # each row's share of the budget, from the base score
        first = (budgets * self.first_stage_ratio).floor().long()
        if self.first_stage_ratio > 0:
            first = first.clamp_min(1)
        if self.first_stage_min > 0:
            first = first.clamp_min(max(1, math.floor(self.first_stage_min * (view.budget or 0) + 1e-9)))
        first = torch.minimum(first, budgets)
        weighted = (base + self.epsilon) * view.stats[FEATURE]
        weighted = weighted.masked_fill(extreme(view.ranked(base), first, largest=True), float("inf"))
        return weighted.masked_fill(extreme(view.ranked(weighted), budgets, largest=True), float("inf"))


def projected_value_l1(values: torch.Tensor, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """‖W_o,h v‖₁ averaged over the query heads h of the group: values [r, q, D] of one KV head, its columns of
    W_o [hidden, group × D] -> [r, q]. A block of entries at a time: the projections of a long prompt at once
    would take q × group × hidden floats."""
    w = weights["output_projection"].to(torch.float32)
    r, q, d = values.shape
    group = w.shape[1] // d
    per_head = w.view(w.shape[0], group, d).permute(2, 1, 0).reshape(d, group * w.shape[0])  # [D, group × hidden]
    flat = values.to(torch.float32).reshape(r * q, d)
    norms = [(block @ per_head).view(-1, group, w.shape[0]).abs().sum(dim=-1) for block in flat.split(BLOCK)]
    return torch.cat(norms).mean(dim=-1).view(r, q)
