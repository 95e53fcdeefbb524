"""HeadKV's per-head budgets (Fu et al. 2024, arXiv:2410.19258): every KV head of every layer keeps a shared base,
and a pool is spread over the heads in proportion to their retrieval scores, saved by
``kvbench-profile mode=retrieval_heads`` (``kvbench.profile.retrieval_heads``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvbench.policies.allocations.adaptive import extreme
from kvbench.policies.base import Allocation
from kvbench.policies.parts import register_allocation
from kvbench.policies.state import TokenState


@register_allocation("headkv")
class HeadKV(Allocation):
    """Row (layer l, KV head h) of a sequence keeps b_lh = (1 - pool)·B + pool·B·L·H · s_lh / Σs, with s the saved
    retrieval scores (uniform where every score is 0) and B the run's per-row budget: the total is L·H·B, the
    uniform split's. Whole tokens: each b_lh is clipped to [the row's protected entries, what it holds], the
    clipped amount spread over the rows that can still move, rounded down, and the remaining tokens given to the
    largest fractional parts (ties: the earlier row). Inside a row the score ranks (SnapKV's, in
    configs/policy/profiled/headkv.yaml). The split spans every layer of a sequence (``pools_layers``), so the
    cache evicts a sequence's layers together, once their total is over L·H·B."""

    per_head = True
    pools_layers = True

    def __init__(self, scores: str, pool: float = 0.5):
        if not 0.0 <= float(pool) <= 1.0:
            raise ValueError(f"pool={pool} must be in [0, 1] (the share of each head's budget that is pooled)")
        path = Path(scores)
        if not path.is_file():
            raise ValueError(
                f"allocation scores {scores!r} is not a file; measure them with kvbench-profile mode=retrieval_heads"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("kind") != "retrieval_heads":
            raise ValueError(
                f"{scores!r} holds no retrieval-head scores; write them with kvbench-profile mode=retrieval_heads"
            )
        self.path, self.pool = str(scores), float(pool)
        self.model = str(data.get("model"))
        self.layers, self.kv_heads = int(data["layers"]), int(data["kv_heads"])
        weights = torch.tensor(data["scores"], dtype=torch.float64)
        if weights.shape != (self.layers, self.kv_heads) or bool((weights < 0).any()):
            raise ValueError(f"{scores!r}: scores must be [layers][kv_heads] of values >= 0")
        self.weights = weights.flatten()

    def heads_problem(self, n_layers: int, kv_heads: int) -> str | None:
        if (n_layers, kv_heads) == (self.layers, self.kv_heads):
            return None
        return (
            f"allocation scores {self.path!r} were measured on {self.model} ({self.layers} layers of {self.kv_heads} "
            f"KV heads); this model has {n_layers} of {kv_heads}: measure it with kvbench-profile mode=retrieval_heads"
        )

    def row_budgets(
        self, rows: torch.Tensor, lengths: torch.Tensor, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """Long [r]: what each row keeps, ``rows`` [r] their (layer × kv_heads + head), ``lengths`` what they hold
        (that their next query can see), ``protected`` what the scope protects in each."""
        if int(rows.max()) >= self.weights.numel():
            raise ValueError(
                f"row {int(rows.max())} is past the {self.layers} × {self.kv_heads} heads of {self.path!r}"
            )
        weights = self.weights.to(rows.device)[rows]
        weights = weights if float(weights.sum()) > 0 else torch.ones_like(weights)
        count = rows.numel()
        raw = (1 - self.pool) * budget + self.pool * budget * count * weights / weights.sum()
        hi = lengths.to(torch.float64)
        lo = torch.minimum(protected.to(torch.float64), hi)
        return whole(raw, lo, hi, min(count * budget, int(lengths.sum())))

    def keep_rows(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        valid = state.valid_mask()
        ranked = scores.masked_fill(~valid, float("-inf"))
        outside = state.outside_window()  # a sliding layer's entries its next query cannot see: never worth a token
        visible = valid if outside is None else valid & ~outside
        counts = self.row_budgets(state.row_keys[:, 0], visible.sum(dim=1), torch.isposinf(ranked).sum(dim=1), budget)
        return extreme(ranked, counts, largest=True) & valid

    def describe(self) -> str:
        return f"headkv(pool={self.pool:g}, {Path(self.path).name})"


def whole(raw: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, total: int) -> torch.Tensor:
    """Whole counts in [lo, hi] summing to ``total`` (or to what the bounds allow), near ``raw``: clipped, the
    difference spread evenly over the rows that can still move, rounded down, the rest to the largest fractions."""
    vals = torch.minimum(torch.maximum(raw, lo), hi)
    for _ in range(raw.numel() + 1):
        diff = total - float(vals.sum())
        if abs(diff) < 1e-9:
            break
        free = vals < hi if diff > 0 else vals > lo
        if not bool(free.any()):
            break
        vals = torch.where(free, torch.minimum(torch.maximum(vals + diff / int(free.sum()), lo), hi), vals)
    out = torch.floor(vals + 1e-9)
    short = total - int(out.sum())
    if short > 0:
        room = out + 1 <= hi
        fraction = torch.where(room, vals - out, torch.full_like(vals, -math.inf))
        order = torch.argsort(-fraction, stable=True)[: min(short, int(room.sum()))]
        out[order] += 1
    return out.to(torch.long)
