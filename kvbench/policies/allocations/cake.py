"""CAKE's layer budgets (Qin et al. 2025): each layer's share of the cache from its attention's dispersion and
shift over the observation window, decided per prompt."""

from __future__ import annotations

import torch

from kvbench.policies.allocations.adaptive import extreme
from kvbench.policies.base import Allocation
from kvbench.policies.layer_split import fit_total, integer_split
from kvbench.policies.parts import register_allocation
from kvbench.policies.state import TokenState


@register_allocation("cake")
class CakeLayers(Allocation):
    """Every layer of a sequence shares ``layers × budget`` entries per KV head, in proportion to its preference
    P_l = H_l^(1/tau1) · V_l^(1/tau2), read from the attention of the score's observation window (its query log:
    the last W queries, W the score's ``window``) on the entries before the window:

    - H_l, spatial dispersion: the entropy −Σ p log p of those attention probabilities, summed over the window's
      queries, the entries and the layer's KV heads;
    - V_l, temporal shift: each entry's variance over the window's queries (unbiased), summed over the entries and
      the heads.

    Each layer first keeps what the scope protects (the window); the rest, ``layers × budget`` less what is
    protected, is split as P_l / Σ P, capped at what a layer holds (the excess spread evenly over the others, as
    CAKE's authors do) and rounded to whole tokens with the exact total. Every KV head of layer l keeps its
    protected entries and its B_l − protected best scores.

    CAKE decides the budgets while the prompt is encoded, layer by layer: after layer m it evicts layers 0..m to
    P_l / Σ_{k≤m} P_k of their share, so the cache never holds more than the budget plus one layer's prompt. A
    layer's budget only shrinks as layers come, and its indicator is fixed once its own attention is done, so the
    final kept sets are those of one split over every layer's preference, which kvbench makes at the end of the
    prompt's step, every layer at once (``pools_layers``): the kept sets are CAKE's, the peak memory within the
    prompt step is the whole prompt's in every layer (a prefill ``stride`` bounds it). Like ``global``, the rows
    store just what they keep, so resident memory is the budget's."""

    per_head = True  # layers hold different counts
    pools_layers = True
    needs = frozenset({"qlog", "count"})

    def __init__(self, tau1: float = 1.0, tau2: float = 1.0):
        if not (float(tau1) > 0.0 and float(tau2) > 0.0):
            raise ValueError(f"cake tau1={tau1}, tau2={tau2} must be > 0 (the preference's temperatures)")
        self.tau1 = float(tau1)
        self.tau2 = float(tau2)

    def preferences(self, state: TokenState) -> torch.Tensor:
        """P per (layer, sequence) unit of ``state``, float64 [units]."""
        rows = state.stats["qlog"].to(torch.float64)  # [R, W, n]
        w = rows.shape[1]
        before = state.valid_mask() & (state.stats["count"] > w)  # entries before the window
        p = rows * before.unsqueeze(1)
        dispersion = -torch.special.xlogy(p, p).sum(dim=(1, 2))
        mean = p.mean(dim=1, keepdim=True)
        shift = ((p - mean).square().sum(dim=1) / max(w - 1, 1) * before).sum(dim=1)
        h = state.per_unit(dispersion.unsqueeze(1)).sum(dim=(1, 2))
        v = state.per_unit(shift.unsqueeze(1)).sum(dim=(1, 2))
        return h.clamp_min(0.0) ** (1.0 / self.tau1) * v.clamp_min(0.0) ** (1.0 / self.tau2)

    def layer_counts(self, state: TokenState, scores: torch.Tensor, budget: int) -> list[int]:
        """B_l per unit: what each KV head of the unit keeps."""
        valid = state.valid_mask()
        held = state.per_unit(valid.sum(dim=1, keepdim=True)).amin(dim=(1, 2))
        protected = state.per_unit((torch.isposinf(scores) & valid).sum(dim=1, keepdim=True)).amax(dim=(1, 2))
        units = held.shape[0]
        free = max(units * budget - int(protected.sum()), 0)
        caps = (held - protected).clamp_min(0).tolist()
        pref = self.preferences(state)
        total = float(pref.sum())
        shares = (pref / total).tolist() if total > 0 and torch.isfinite(pref).all() else [1.0 / units] * units
        goal = min(free, int(sum(caps)))
        split = integer_split(fit_total([free * s for s in shares], 0.0, caps, goal), 0.0, caps, goal)
        return [int(p) + b for p, b in zip(protected.tolist(), split)]

    def keep_rows(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        counts = torch.tensor(self.layer_counts(state, scores, budget), device=scores.device)
        valid = state.valid_mask()
        k = counts.repeat_interleave(state.heads // state.units).minimum(valid.sum(dim=1))
        return extreme(scores.masked_fill(~valid, float("-inf")), k, largest=True) & valid

    def describe(self) -> str:
        return f"cake(tau1={self.tau1:g}, tau2={self.tau2:g})"
