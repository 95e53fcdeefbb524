"""CaM (Zhang et al., ICML 2024): an evicted entry's value is merged into the kept entries that follow it."""

from __future__ import annotations

import torch

from kvbench.policies.merge import MERGES, Merge, Merged
from kvbench.policies.scores.uniform_random import uniform_hash
from kvbench.policies.state import TokenState

STREAM = 1 << 20  # CaM's draws use the run's seed shifted by this, apart from the random score's


@MERGES.register("cam")
class CamMerge(Merge):
    """CaM's cache merging. Each evicted entry e of a row is merged, with probability

        p_e = clamp(A_e / mean(A_j for j in T_e), 0, 1),

    into T_e, the ``merge_budget`` (m) kept entries that follow it in sequence order (fewer when fewer follow):
    each v_j, j in T_e, gains M_e · v_e / |T_e|, M_e ~ Bernoulli(p_e). A is the attention an entry has received,
    summed over the queries that saw it (``acc``): an evicted entry that drew as much attention as its successors
    is merged for sure, a neglected one rarely. Keys, positions and statistics stay as they are.

    Every entry an eviction drops is a candidate: one per decode step at a budget, as in CaM, and every dropped
    entry of a larger eviction (a prompt chunk, or a schedule that evicts every k steps). kvpress's CAMPress
    merges, of a larger eviction, only as many as decode steps since its last one, the highest-scored first, and
    sums A over decode steps only. M_e is drawn from a hash of the run's seed, the row, the entry's position and
    the tokens fed, so a sequence merges alike alone or in any batch.
    """

    needs = frozenset({"acc"})

    def __init__(self, merge_budget: int = 32):
        if isinstance(merge_budget, bool) or not isinstance(merge_budget, int) or merge_budget < 1:
            raise ValueError(f"merge_budget={merge_budget!r} must be a positive integer (kept entries merged into)")
        self.merge_budget = merge_budget

    def __call__(self, state: TokenState, keep: torch.Tensor) -> Merged:
        draws = uniform_hash(state.seed + STREAM, state.row_keys, state.positions, state.seen)
        values = merged_values(state.values, state.stats["acc"], keep, state.valid_mask(), draws, self.merge_budget)
        return Merged(state.keys.to(torch.float32), values, None)


def merged_values(
    values: torch.Tensor,
    acc: torch.Tensor,
    keep: torch.Tensor,
    valid: torch.Tensor,
    draws: torch.Tensor,
    merge_budget: int,
) -> torch.Tensor:
    """values [H, n, D], acc [H, n], keep and valid [H, n] bool, draws [H, n] uniform in [0, 1): the values after
    CaM's merge, float32. In rank order (the k-th kept entry of a row), an evicted entry e adds its share to the
    ranks [s_e, s_e + |T_e|), s_e the kept entries before it: a difference array summed along the ranks, so the
    cost is O(n · D) whatever the merge budget."""
    h, n, d = values.shape
    evicted = valid & ~keep
    before = torch.cumsum(keep, dim=1) - keep.long()  # s_e: kept entries before each entry
    targets = (keep.sum(dim=1, keepdim=True) - before).clamp(max=merge_budget) * evicted  # |T_e|
    # A over each T_e, from the prefix sums of the kept entries' A in rank order.
    kept_acc = torch.cumsum(torch.where(keep, acc, 0.0).double(), dim=1)
    ranked = torch.zeros(h, n + 1, dtype=torch.float64, device=values.device)
    ranked.scatter_(1, torch.where(keep, before + 1, 0), torch.where(keep, kept_acc, 0.0))
    window = ranked.gather(1, before + targets) - ranked.gather(1, before)
    own = acc.double()
    ratio = torch.where(window > 0, own * targets / window.clamp_min(1e-300), (own > 0).double())
    merging = (draws.double() < ratio.clamp(0.0, 1.0)) & (targets > 0)
    share = values.double() * (merging / targets.clamp_min(1)).unsqueeze(-1)
    diff = torch.zeros(h, n + 1, d, dtype=torch.float64, device=values.device)
    diff.scatter_add_(1, before.unsqueeze(-1).expand(-1, -1, d), share)
    diff.scatter_add_(1, (before + targets).unsqueeze(-1).expand(-1, -1, d), -share)
    gained = torch.cumsum(diff, dim=1).gather(1, before.unsqueeze(-1).expand(-1, -1, d))
    return (values.double() + gained * keep.unsqueeze(-1)).to(torch.float32)
