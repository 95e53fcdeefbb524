"""CAPKV's capacity score (kvpress's CapPress)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.blocks import by_row_blocks
from kvbench.policies.inputs import EVERY, Queries
from kvbench.policies.parts import register_score
from kvbench.policies.scores.noncausal_attn import prompt_queries
from kvbench.policies.state import TokenState


@register_score("cap")
class CAP(Score):
    """CAPKV: a token's share of the capacity A = I + Σᵢ wᵢ vᵢvᵢᵀ, sᵢ = wᵢ · vᵢᵀA⁻¹vᵢ, with relevance weights
    wᵢ = exp(τ · cos(kᵢ, μ)) (shifted by their maximum) and μ the historical-query anchor: the mean of the prompt's
    queries before RoPE, rotated by RoPE averaged over the ``n_future_positions`` positions after the prompt.
    Per query head, then the mean over the KV head's GQA group, as kvpress's CapPress (defaults included): keys
    normalised, values standing in for the output directions, ε = ``epsilon`` added to w under the square root.
    The first ``n_sink`` tokens are left out of every sum and are the scope's to keep (configs/policy/cap.yaml).

    The anchor reads every prompt query, so the rule scores the prompt fed in one step: decode and ``both`` are
    refused, and so is a prefill ``stride``. kvbench computes in float32 where kvpress uses the model's dtype."""

    queries = Queries(last=EVERY, rope=False)
    rope = True
    whole_prompt = True
    unsupported_stages = ("decode", "both")
    why_unsupported = "CAPKV's query anchor is the mean of every prompt query, so it compresses the prompt only"

    def __init__(self, tau: float = 5.0, n_future_positions: int = 512, n_sink: int = 4, epsilon: float = 1e-6):
        if int(n_future_positions) < 1 or int(n_sink) < 0 or float(epsilon) < 0:
            raise ValueError(
                f"n_future_positions={n_future_positions} must be >= 1, n_sink={n_sink} and epsilon={epsilon} >= 0"
            )
        self.tau, self.epsilon = float(tau), float(epsilon)
        self.n_future_positions, self.n_sink = int(n_future_positions), int(n_sink)

    def __call__(self, view: TokenState) -> torch.Tensor:
        queries = prompt_queries(view)[:, :, self.n_sink :].to(torch.float32)  # [r, group, m, D], before RoPE
        keys = view.keys_after_rope[:, self.n_sink :].to(torch.float32)
        values = view.values[:, self.n_sink :].to(torch.float32)
        anchor = self.future_rotated(view, queries.mean(dim=2))
        group, m, dim = queries.shape[1:]
        scores = by_row_blocks(self.capacity, (anchor, keys, values), per_row=group * m * dim)
        return F.pad(scores, (self.n_sink, 0), value=float("inf"))  # kvpress: above every other score

    def future_rotated(self, view: TokenState, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [r, group, D] rotated by each row's RoPE averaged over the positions after the prompt."""
        assert view.rope is not None, "the cache hands a score that declares rope its rows' RoPE"
        seen = view.seen if view.seen is not None else view.positions.amax(dim=1, keepdim=True) + 1
        start = torch.as_tensor(seen, device=anchor.device).reshape(-1, 1).expand(anchor.shape[0], 1)
        future = start + torch.arange(self.n_future_positions, device=anchor.device)  # [r, P]
        return view.rope.averaged(anchor, future.unsqueeze(1))

    def capacity(self, anchor: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Scores [r, m] from the anchor [r, group, D] and the non-sink keys and values [r, m, D]."""
        cosine = (F.normalize(anchor, dim=-1) @ F.normalize(keys, dim=-1).transpose(1, 2)).clamp(-1.0, 1.0)
        logits = self.tau * cosine  # [r, group, m]
        weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        scaled = values.unsqueeze(1) * torch.sqrt(weights + self.epsilon).unsqueeze(-1)  # [r, group, m, D]
        eye = torch.eye(values.shape[-1], device=values.device, dtype=values.dtype)
        capacity = eye + scaled.transpose(-1, -2) @ scaled  # [r, group, D, D]
        inverse = torch.cholesky_inverse(torch.linalg.cholesky(capacity))  # A is I + a Gram matrix: positive definite
        leverage = ((values.unsqueeze(1) @ inverse) * values.unsqueeze(1)).sum(dim=-1)  # vᵢᵀA⁻¹vᵢ, [r, group, m]
        return (weights * leverage).mean(dim=1)
