"""Compactor: approximate leverage of the keys blended with non-causal chunked attention (kvpress's
CompactorPress)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.inputs import EVERY, Queries
from kvbench.policies.parts import register_score
from kvbench.policies.scores.leverage import gaussian_sketch, sketched_leverage
from kvbench.policies.scores.noncausal_attn import noncausal_scores, prompt_queries
from kvbench.policies.state import TokenState
from kvbench.policies.zscore import unit_zscore


@register_score("compactor")
class Compactor(Score):
    """Compactor (Chari & Van Durme 2025): ``blending`` × the keys' leverage (``leverage``) + non-causal chunked
    attention × value norm (``noncausal_attn``), each z-scored over the layer's heads. As kvpress's CompactorPress,
    the first ``sink_start`` and last ``sink_end`` held tokens are left out of both (out of the centring, the
    sketch's Gram matrix, the chunks, which start after the sinks, and the z-scores) and rank above the rest; the
    scope keeps them too (configs/policy/compactor.yaml). ``blending`` None is kvpress's default: the share this
    eviction removes, 1 − budget / held (kvpress's compression_ratio, which kvbench's budget rounds to a whole
    token count). The sketch is seeded as ``leverage``'s. Reads every prompt query: decode, ``both`` and a prefill
    ``stride`` are refused."""

    queries = Queries(last=EVERY, rope=True)
    rope = True
    whole_prompt = True
    unsupported_stages = ("decode", "both")
    why_unsupported = "Compactor's non-causal attention needs every prompt query, so it compresses the prompt only"

    def __init__(
        self,
        blending: float | None = None,
        sink_start: int = 8,
        sink_end: int = 4,
        chunk_size: int = 256,
        sketch_dimension: int = 48,
    ):
        if min(int(sink_start), int(sink_end)) < 0 or min(int(chunk_size), int(sketch_dimension)) < 1:
            raise ValueError(
                f"sink_start={sink_start} and sink_end={sink_end} must be >= 0, chunk_size={chunk_size} and "
                f"sketch_dimension={sketch_dimension} >= 1"
            )
        self.blending = None if blending is None else float(blending)
        self.sink_start, self.sink_end = int(sink_start), int(sink_end)
        self.chunk_size, self.sketch_dimension = int(chunk_size), int(sketch_dimension)

    def __call__(self, view: TokenState) -> torch.Tensor:
        queries, n = prompt_queries(view), view.length
        start = min(self.sink_start, n)
        end = n - min(self.sink_end, n - start)
        if end == start:
            return torch.zeros(view.heads, n, device=queries.device)
        keys = view.keys_before_rope[:, start:end]
        sketch = gaussian_sketch(view.seed, view.row_keys, keys.shape[-1], self.sketch_dimension)
        leverage = unit_zscore(sketched_leverage(keys, None, sketch), None, view.units)
        attention = noncausal_scores(
            queries[:, :, start:end], view.keys_after_rope[:, start:end], view.values[:, start:end], self.chunk_size
        )
        scores = self.weight(view) * leverage + unit_zscore(attention, None, view.units)
        return F.pad(scores, (start, n - end), value=float("inf"))  # kvpress: the maximum, so kept first

    def weight(self, view: TokenState) -> float:
        """The leverage's weight in the blend."""
        if self.blending is not None:
            return self.blending
        if view.budget is None:
            raise ValueError("compactor's default blending is the share evicted: the view needs its budget")
        return 1.0 - view.budget / view.length
