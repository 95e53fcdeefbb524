"""Expected Attention: the attention the coming queries are expected to pay each entry, from the prompt's queries."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvbench.policies.base import Score
from kvbench.policies.inputs import Queries
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("expected_attention")
class ExpectedAttention(Score):
    """Expected Attention (Devoto et al. 2025): the next queries are modelled as a Gaussian, the mean μ and
    covariance Σ of the step's queries before RoPE, each turned by R̄, the mean of the model's rotations over
    the ``n_future_positions`` positions after the step. Under it the expected unnormalised attention of key k
    is exp(μ̄·k/√d + kᵀΣ̄k/(2d)) (μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ, d the head dimension), normalised over the row's entries
    per query head, averaged over the KV head's GQA group and, with ``use_vnorm``, (p + ``epsilon``) × ‖v‖₂.

    As kvpress's ExpectedAttentionPress (its defaults): the queries at positions below ``n_sink`` are left out
    of the statistics (outliers), the entries there out of the normalisation, and those entries score +inf
    (kept); Σ divides by the count of queries, and the logit scale is 1/√d whatever the family's own. The
    statistics come from the evicting step's last ``last_queries`` queries, kvpress's from all the prompt's:
    the same on a prompt of up to ``last_queries`` tokens fed in one step (prefill); a longer prompt, or one fed
    in chunks, gives the statistics of its last queries. A decode step has one query, too few for a mean and a
    covariance: the score is refused there (kvpress re-scores decoding from a buffer of recent hidden states).
    """

    label = "Expected Attention"

    unsupported_stages = ("decode", "both")
    why_unsupported = (
        "Expected Attention models the coming queries from the evicting step's own; a decode step has one, too "
        "few for their mean and covariance"
    )

    def __init__(
        self,
        n_future_positions: int = 512,
        n_sink: int = 4,
        use_covariance: bool = True,
        use_vnorm: bool = True,
        epsilon: float = 0.0,
        last_queries: int = 4096,
    ):
        if int(n_future_positions) < 1:
            raise ValueError(f"n_future_positions={n_future_positions} must be >= 1")
        if int(n_sink) < 0:
            raise ValueError(f"n_sink={n_sink} must be >= 0")
        if float(epsilon) < 0:
            raise ValueError(f"epsilon={epsilon} must be >= 0")
        if int(last_queries) < 2:
            raise ValueError(f"last_queries={last_queries} must be >= 2 (a mean and a covariance)")
        self.queries = Queries(last=int(last_queries), rope=False, ahead=int(n_future_positions))
        self.n_sink = int(n_sink)
        self.use_covariance = bool(use_covariance)
        self.use_vnorm = bool(use_vnorm)
        self.epsilon = float(epsilon)
        self.feature_names = frozenset({"value_l2"}) if self.use_vnorm else frozenset()

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {"value_l2": values.to(torch.float32).norm(dim=-1)} if self.use_vnorm else {}

    def __call__(self, view: TokenState) -> torch.Tensor:
        assert view.queries is not None, "the engine hands over the queries the score declared"
        queries = view.queries.to(torch.float32)  # [rows, group, k, D], turned by the coming positions' mean
        k, d = queries.shape[2], queries.shape[3]
        seen = torch.as_tensor(view.seen, device=queries.device).reshape(-1, 1)  # tokens fed, the step's included
        at = seen - k + torch.arange(k, device=queries.device)  # [rows or 1, k]: each query's position
        used = at >= self.n_sink
        used = (used | ~used.any(dim=1, keepdim=True)).to(torch.float32).view(-1, 1, k, 1)  # none: every query
        count = used.sum(dim=2)  # [rows, 1, 1]
        mean = (queries * used).sum(dim=2) / count  # [rows, group, D]
        keys = view.keys.to(torch.float32)  # [rows, n, D]
        logits = torch.einsum("rgd,rnd->rgn", mean, keys) / math.sqrt(d)
        if self.use_covariance:
            centred = (queries - mean.unsqueeze(2)) * used
            cov = centred.transpose(2, 3) @ centred / count.unsqueeze(-1)  # [rows, group, D, D]
            logits = logits + torch.einsum("rgne,rne->rgn", torch.einsum("rnd,rgde->rgne", keys, cov), keys) / (2 * d)
        sinks = view.positions < self.n_sink
        if view.valid is not None:
            sinks = sinks & view.valid
        excluded = sinks if view.valid is None else sinks | ~view.valid
        probs = logits.masked_fill(excluded.unsqueeze(1), float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        scores = probs.mean(dim=1)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.stats["value_l2"]
        return scores.masked_fill(sinks, float("inf"))
