"""``allocation=layers``: an explicit per-layer budget list (kvpress's ``PerLayerCompressionPress``), with the run's
budget as the layers' mean."""

from __future__ import annotations

from kvbench.policies.base import Allocation
from kvbench.policies.layer_split import fit_total, integer_split
from kvbench.policies.parts import register_allocation


@register_allocation("layers")
class Layers(Allocation):
    """Layer l keeps a share ``budgets[l]`` of the prompt, scaled so that the layers' mean is the run's budget.

    ``budgets`` lists one value in (0, 1] per layer under the budget (every decoder layer; a hybrid model's
    full-attention layers): the share of the reference length the layer keeps, kvpress's ``1 - compression_ratios``.
    The run's budget B (per row, mean over layers) sets the total, L·B tokens per KV head as under the uniform split,
    and layer l gets L·B·budgets[l] / Σ budgets, clipped to [1, limit] and rounded to whole tokens with that exact
    total (``min(L·B, L·limit)``). So a run whose budget is the list's mean keeps the list's shares (kvpress's
    presses, up to its rounding down per layer), and a sweep over budgets keeps the list's shape. A list of another
    length than the model's layers is refused before the weights load.
    """

    def __init__(self, budgets: list[float]):
        if not budgets:
            raise ValueError("budgets=[] lists no layer; give one share in (0, 1] per layer: budgets=[0.5, 0.25, ...]")
        bad = [b for b in budgets if not 0.0 < float(b) <= 1.0]
        if bad:
            raise ValueError(
                f"budgets {bad} must each be a share of the prompt in (0, 1] (layer l keeps that share, scaled so the "
                "layers' mean is the run's budget)"
            )
        self.budgets = [float(b) for b in budgets]

    def layers_problem(self, n_layers: int) -> str | None:
        if n_layers == len(self.budgets):
            return None
        return (
            f"allocation=layers lists {len(self.budgets)} budgets; this model splits its budget over {n_layers} "
            f"layers: give policy.allocation.budgets one share per layer ({n_layers} values)"
        )

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None, reserved: int = 0) -> list[int]:
        problem = self.layers_problem(n_layers)
        if problem:
            raise ValueError(problem)
        hi = float(limit) if limit is not None else float("inf")
        total = int(min(n_layers * budget, n_layers * hi))
        raw = [n_layers * budget * b / sum(self.budgets) for b in self.budgets]
        return integer_split(fit_total(raw, 1.0, hi, total), 1.0, hi, total)

    def describe(self) -> str:
        return f"layers({len(self.budgets)} budgets)"
