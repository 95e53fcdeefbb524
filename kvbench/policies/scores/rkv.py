"""R-KV: attention importance minus key redundancy, for compressing what a reasoning model generates."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.scores.snapkv import pool_neighbours
from kvbench.policies.state import TokenState

BLOCK_ELEMENTS = 1 << 22  # similarities computed a block of rows at a time, never [rows, n, n] at once


@register_score("rkv")
class RKV(Score):
    """R-KV (Cai et al. 2025): score = λ · I − (1 − λ) · R over the entries before the observation window.

    I, importance: the attention the last ``window`` queries (α, the observation window: the layer's query log)
    paid each earlier entry, each query's row renormalised over those entries alone (the paper's softmax over
    them), averaged over the queries, then max-pooled over ``kernel_size`` neighbours as SnapKV pools (the window
    left out). R, redundancy: with S the cosine similarity of the row's keys (S_ii = 0), each key i spares the
    most recent key j it is more similar to than ``threshold`` (S_ij = 0), then R = softmax over the row of each
    key's mean similarity to the others, Σ_i S_ij / n. A key like many others is redundant and goes first. The
    window's own entries are kept by the scope (configs/policy/rkv.yaml), as R-KV keeps them.

    Where kvbench differs: a GQA group's attention is the mean of its query heads' probabilities (R-KV's code
    takes the maximum of their logits), and a key with no key above the threshold spares none (R-KV's code then
    zeroes its similarity to the first key). The similarities cost O(n²·D) per row at each eviction: R-KV
    evicts once per buffer of decode steps, so that cost is shared by the buffer's steps. Refused in
    stage=prefill: R-KV compresses the tokens a model generates.
    """

    needs = frozenset({"qlog", "count"})
    unsupported_stages = ("prefill",)
    why_unsupported = "R-KV compresses what the model generates, while it decodes"

    def __init__(self, window: int = 8, kernel_size: int = 7, mix_lambda: float = 0.1, threshold: float = 0.5):
        if int(window) < 1:
            raise ValueError(f"window={window} must be >= 1 query (R-KV's α)")
        if int(kernel_size) < 1 or int(kernel_size) % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size} must be a positive odd number")
        if not 0.0 <= float(mix_lambda) <= 1.0:
            raise ValueError(f"mix_lambda={mix_lambda} must be in [0, 1] (the weight of attention against redundancy)")
        self.history = self.window = int(window)
        self.kernel_size = int(kernel_size)
        self.mix_lambda = float(mix_lambda)
        self.threshold = float(threshold)

    def __call__(self, state: TokenState) -> torch.Tensor:
        valid = state.valid_mask()
        window = (state.stats["count"] <= self.window) & valid
        importance = observed_importance(state.stats["qlog"], valid & ~window)
        pooled = pool_neighbours(importance, self.kernel_size, "max", window)
        redundancy = key_redundancy(state.keys, valid, self.threshold)
        return self.mix_lambda * pooled - (1.0 - self.mix_lambda) * redundancy


def observed_importance(log: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """[H, n]: each logged query's attention row [H, W, n] renormalised over the ``past`` entries (bool [H, n]),
    averaged over the queries that saw any of them; 0 outside ``past``."""
    rows = log * past.unsqueeze(1)
    mass = rows.sum(dim=-1, keepdim=True)
    queries = (mass > 0).sum(dim=1).clamp_min(1)
    return (rows / mass.clamp_min(torch.finfo(rows.dtype).tiny)).sum(dim=1) / queries


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy [H, n] of keys [H, n, D] (``valid`` [H, n]: the row's entries): the softmax over the row
    of Σ_i S_ij / n, S the keys' cosine similarities without the diagonal and without, for each key i, its
    similarity to the most recent key above ``threshold``. The column sums come from the row's sum of unit keys;
    only the spared similarities need the pairs, a block of rows at a time."""
    h, n, _ = keys.shape
    unit = F.normalize(keys.float(), dim=-1) * valid.unsqueeze(-1)
    total = unit.sum(dim=1, keepdim=True)
    column = (unit * total).sum(dim=-1) - (unit * unit).sum(dim=-1)
    spared = torch.zeros(h, n, device=keys.device)
    index = torch.arange(n, device=keys.device)
    block = max(1, BLOCK_ELEMENTS // max(1, h * n))
    for start in range(0, n, block):
        end = min(n, start + block)
        sim = torch.einsum("hbd,hnd->hbn", unit[:, start:end], unit)
        similar = (sim > threshold) & valid.unsqueeze(1) & (index != index[start:end].unsqueeze(1))
        latest = torch.where(similar, index, -1).amax(dim=-1)
        found = (latest >= 0) & valid[:, start:end]
        target = latest.clamp_min(0)
        spared.scatter_add_(1, target, sim.gather(2, target.unsqueeze(-1)).squeeze(-1) * found)
    lengths = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    mean = ((column - spared) / lengths).masked_fill(~valid, float("-inf"))
    return torch.softmax(mean, dim=-1).nan_to_num(0.0)
