"""``allocation=profiled``: per-layer budgets in proportion to a layer statistic of a saved attention profile
(``kvbench-profile``'s ``profile.json``), with the same total as the uniform split.

The default statistic, ``coverage_90``, is the fraction of its keys a layer's queries need for 90 % of their
attention: a layer whose attention is spread out gets more of the budget, a concentrated one less (the field's
advice: early layers are more uniform, later ones more concentrated).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.policies.base import Allocation
from kvbench.policies.layer_split import fit_total, integer_split
from kvbench.policies.parts import register_allocation

# Layer statistics of a profile where more means the layer needs more of its keys.
STATISTICS = ("coverage_90", "coverage_95", "entropy")


@register_allocation("profiled")
class Profiled(Allocation):
    """Layer l gets r + (L·B - L·r) · w_l / Σw, with w a profile's per-layer ``statistic`` and r the scope's
    reserved tokens (kept in every layer, as PyramidKV keeps them); clipped to [min(r + 1, B), limit] with the
    clipped amount spread over the other layers, in integers summing to ``min(L·B, L·limit)``."""

    def __init__(self, profile: str, statistic: str = "coverage_90"):
        if statistic not in STATISTICS:
            raise ValueError(f"allocation statistic {statistic!r} must be one of {STATISTICS}")
        path = Path(profile)
        if not path.is_file():
            raise ValueError(f"allocation profile {profile!r} is not a file; write one with kvbench-profile")
        data = json.loads(path.read_text())
        self.profile, self.statistic = str(profile), statistic
        self.weights = [float(w) for w in data["layers"][statistic]]
        self.budget_layers = [int(i) for i in data.get("budget_layers", range(len(self.weights)))]
        self.model = str(data.get("model"))
        if min(self.weights) <= 0:
            raise ValueError(f"profile {profile!r}: {statistic} must be positive in every layer")

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None, reserved: int = 0) -> list[int]:
        if n_layers == len(self.weights):
            weights = self.weights
        elif n_layers == len(self.budget_layers):  # a hybrid model's full-attention layers
            weights = [self.weights[i] for i in self.budget_layers]
        else:
            raise ValueError(
                f"allocation profile {self.profile!r} (model {self.model}) has {len(self.weights)} layers, "
                f"{len(self.budget_layers)} under the budget; this model splits its budget over {n_layers}: "
                "profile this model with kvbench-profile"
            )
        hi = float(limit) if limit is not None else float("inf")
        reserved = min(reserved, budget)
        lo = float(min(reserved + 1, budget))
        total = int(min(n_layers * budget, n_layers * hi))
        free = n_layers * (budget - reserved)
        raw = [reserved + free * w / sum(weights) for w in weights]
        return integer_split(fit_total(raw, lo, hi, total), lo, hi, total)

    def describe(self) -> str:
        return f"profiled({self.statistic}, {Path(self.profile).name})"
