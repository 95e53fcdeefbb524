"""TriAttention's score: each key's expected attention from the model's calibrated query centres, as a
trigonometric series over the distance from the coming queries (Mao et al. 2026)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.query_centres import QueryCentres, pair_moduli
from kvbench.policies.state import TokenState

MEASURE = "python -m kvbench.profile.query_centres"


@register_score("triattention")
class TriAttentionScore(Score):
    """TriAttention (Mao et al. 2026): before RoPE a head's queries gather around a centre q̄ (per RoPE pair f a
    complex q̄_f, calibrated once per model, ``calibration``), so a query at distance Δ from a key k pays it on
    average Σ_f s²|q̄_f||k_f| cos(ω_f Δ + arg q̄_f − arg k_f) (s: the model's RoPE attention scale), plus what the
    spread of the queries adds through their norms, Σ_f s²(E|q_f| − |q̄_f|)|k_f|. A key scores the series averaged
    over the coming queries at distances Δ = t − p + d, d in 1, 2, 4, … up to ``max_offset`` (t: tokens fed so
    far, p: the key's position), plus the norm term, the most over its KV head's GQA group of query heads.

    The series is the centre rotated to each coming position, averaged (``Rotary.averaged``), dotted with the key
    as the model rotated it. A decode-time rule: every ``policy.interval`` (β) decode steps the cache is trimmed to
    the budget, the prompt protected (``scope=prompt``); the prompt stage is refused."""

    rope = True
    unsupported_stages = ("prefill", "both")
    why_unsupported = "TriAttention trims what is generated while decoding, the prompt protected"

    def __init__(self, calibration: str | None = None, max_offset: int = 65536):
        if int(max_offset) < 1:
            raise ValueError(f"max_offset={max_offset} must be >= 1")
        self.calibration = None if calibration is None else str(calibration)
        self.max_offset = int(max_offset)
        self._centres: QueryCentres | None = None

    def model_problem(self, config: Any) -> str | None:
        if self.calibration is None:
            return (
                f"score=triattention needs the model's query centres: measure them with {MEASURE} and give "
                "policy.score.calibration=FILE"
            )
        if not Path(self.calibration).is_file():
            return f"policy.score.calibration={self.calibration} is not a file; measure one with {MEASURE}"
        differ = self.centres().mismatch(config)
        if differ:
            return f"policy.score.calibration={self.calibration} was measured on another model ({differ})"
        return None

    def centres(self) -> QueryCentres:
        if self._centres is None:
            if self.calibration is None:
                raise ValueError(f"score=triattention needs policy.score.calibration (measure it with {MEASURE})")
            self._centres = QueryCentres.load(self.calibration)
        return self._centres

    def offsets(self) -> torch.Tensor:
        return torch.tensor([2**i for i in range(self.max_offset.bit_length())], dtype=torch.float32)

    def __call__(self, view: TokenState) -> torch.Tensor:
        assert view.rope is not None and view.seen is not None, "a score reading RoPE gets the rows' RoPE"
        c = self.centres()
        kv_heads = int(c.model["kv_heads"])
        group = c.centre.shape[1] // kv_heads
        key = view.row_keys[:, 0].cpu()
        layer, head = key // kv_heads, key % kv_heads
        heads = head.unsqueeze(1) * group + torch.arange(group)  # [rows, group]: the KV head's query heads
        centre = c.centre[layer.unsqueeze(1), heads].to(view.positions.device)  # [rows, group, D]
        mean_norm = c.pair_norm[layer.unsqueeze(1), heads].to(view.positions.device)  # [rows, group, rot/2]
        seen = torch.as_tensor(view.seen, device=view.positions.device).reshape(-1, 1).expand(len(key), 1)
        coming = (seen.to(torch.float32) + self.offsets().to(seen.device)).unsqueeze(1).expand(-1, group, -1)
        series = torch.einsum("rgd,rnd->rgn", view.rope.averaged(centre, coming), view.keys_after_rope.float())
        norms = []
        for rot, start, end in view.rope.runs:  # the spread's term, in each layer's own RoPE pairs
            excess = mean_norm[start:end] - pair_moduli(centre[start:end], rot)
            keys = pair_moduli(view.keys_before_rope[start:end], rot)
            norms.append(torch.einsum("rgf,rnf->rgn", excess, keys) * rot.scale**2)
        return (series + torch.cat(norms)).amax(dim=1)
