"""PyramidKV: more budget in lower layers, decreasing linearly with depth, same total."""

from __future__ import annotations

from kvbench.policies.base import Allocation
from kvbench.policies.layer_split import fit_total, integer_split
from kvbench.policies.parts import register_allocation


@register_allocation("pyramid")
class Pyramid(Allocation):
    """PyramidKV's layer budgets: a linear ramp from the bottom layer to the top, same total.

    With r the scope's reserved tokens (sinks + recent window, kept in every layer) and f = B - r the free
    part of the average budget B, the top layer gets r + f/β and the bottom r + 2f - f/β, linear in between
    (mean B, as in PyramidKV with β = 20). Budgets are then clipped to [min(r + 1, B), limit] (a layer can
    never use more than it will hold, so a budget at least the sequence length evicts nothing anywhere),
    the clipped amount is spread over the other layers, and rounding keeps the exact integer total
    ``min(L·B, L·limit)``.

    ``ramp: kvpress`` gives kvpress's PyramidKVPress budgets instead: the window inside each layer's count, the
    bottom layer 2B - B/β and the top B/β (clipped at limit - r, the top then raised to keep the mean), layer l
    ``round(bottom - l · step)``; a uniform B wherever that ramp does not fit (the top below r). kvpress ramps the
    unrounded kept share n × (1 - ratio); from a whole-token budget the two agree where that share is whole.
    """

    def __init__(self, beta: float = 20.0, ramp: str = "pyramidkv"):
        if float(beta) < 1.0:
            raise ValueError(f"beta={beta} must be >= 1 (1 = uniform)")
        if ramp not in ("pyramidkv", "kvpress"):
            raise ValueError(f"ramp={ramp!r} must be 'pyramidkv' (the reference code's) or 'kvpress'")
        self.beta = float(beta)
        self.ramp = ramp

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None, reserved: int = 0) -> list[int]:
        if self.ramp == "kvpress":
            return self.kvpress_budgets(budget, n_layers, limit, reserved)
        hi = float(limit) if limit is not None else float("inf")
        if n_layers == 1:
            return [int(min(budget, hi))]
        reserved = min(reserved, budget)
        free = budget - reserved
        top = reserved + free / self.beta
        bottom = reserved + 2 * free - free / self.beta
        raw = [bottom + (top - bottom) * i / (n_layers - 1) for i in range(n_layers)]
        lo = float(min(reserved + 1, budget))
        total = int(min(n_layers * budget, n_layers * hi))
        return integer_split(fit_total(raw, lo, hi, total), lo, hi, total)

    def kvpress_budgets(self, budget: int, n_layers: int, limit: int | None, reserved: int) -> list[int]:
        """kvpress's ramp: its total is L·B only up to rounding."""
        held = float(limit) if limit is not None else float("inf")
        top = budget / self.beta
        bottom = 2 * budget - top
        if bottom >= held - reserved:
            bottom = held - reserved
            top = 2 * budget - bottom
        if not held >= bottom >= top >= reserved:
            return [max(1, budget)] * n_layers
        step = (bottom - top) / (n_layers - 1) if n_layers > 1 else 0.0
        return [round(bottom - layer * step) for layer in range(n_layers)]

    def describe(self) -> str:
        return f"pyramid(beta={self.beta:g})" if self.ramp == "pyramidkv" else f"pyramid(beta={self.beta:g}, kvpress)"
