"""Merging: evicted entries are folded into kept ones instead of being dropped.

A ``Merge`` is what a policy's ``merge`` names: ``true`` (or ``cosine``) is the rule below, ``cam`` CaM's
(``policies.cam``). It reads the layer's state and the keep mask at an eviction and returns the kept entries' new
keys and values, and the attention weight each absorbed when it keeps one (the ``mass`` statistic).

The cosine rule: per KV head, each evicted entry e goes to the kept entry k*(e) = argmax_k cos(key_e, key_k) (cosine
similarity of the stored keys: rotated by their positions, or un-rotated under ``positions: reindex``).
Every kept entry k then becomes the attention-weighted average of itself and everything folded into it:

    x_k <- (w_k · x_k + Σ_{e: k*(e)=k} w_e · x_e) / (w_k + Σ_{e: k*(e)=k} w_e)      for x = key and value,

with weight w = acc + mass: the attention the entry has received (``acc``) plus the attention mass of
entries it absorbed earlier (``mass``), so an entry that stands for several tokens counts as all of them.
The kept entry's ``mass`` then grows by Σ w_e. Its position (and so its RoPE rotation) is its own.
Similarities are computed a block of evicted rows at a time, never an n × n matrix for a long prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvbench.policies.state import TokenState
from kvbench.registry import Registry

BLOCK_ELEMENTS = 1 << 22


@dataclass
class Merged:
    """Every entry's keys and values after a merge, [H, n, D] float32 (only kept entries are written back), and
    the weight each kept entry absorbed, [H, n] (None: the merge keeps no ``mass``)."""

    keys: torch.Tensor
    values: torch.Tensor
    absorbed: torch.Tensor | None


class Merge(ABC):
    """What becomes of the entries an eviction drops. ``needs``: the statistics it reads."""

    needs: frozenset[str] = frozenset()

    @abstractmethod
    def __call__(self, state: TokenState, keep: torch.Tensor) -> Merged:
        """``keep`` [H, n]: what the eviction keeps of ``state``'s entries."""


MERGES: Registry[type[Merge]] = Registry("merge", ("kvbench.policies.merge", "kvbench.policies.cam"), Merge)


@MERGES.register("cosine")
class CosineMerge(Merge):
    """Each evicted entry folded into its most similar kept key, weighted by attention (this module's rule)."""

    needs = frozenset({"acc", "mass"})

    def __call__(self, state: TokenState, keep: torch.Tensor) -> Merged:
        weights = state.stats["acc"] + state.stats["mass"]
        return Merged(*merge_evicted(state.keys, state.values, weights, keep, state.valid))


def merge_evicted(
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [H, n, D], values [H, n, Dv], weights [H, n] (>= 0), keep [H, n] bool, valid [H, n] bool or None.

    Returns (keys, values, absorbed): the merged keys/values for every entry (only kept ones change, float32)
    and the weight each kept entry absorbed, [H, n] (0 elsewhere).
    """
    h, n, _ = keys.shape
    valid = torch.ones_like(keep) if valid is None else valid
    evicted = valid & ~keep
    kf, vf = keys.to(torch.float32), values.to(torch.float32)
    w = weights.to(torch.float32).clamp_min(0.0)
    absorbed = torch.zeros(h, n, device=keys.device)
    if not bool(evicted.any()) or not bool(keep.any()):
        return kf, vf, absorbed
    unit = torch.nn.functional.normalize(kf, dim=-1)
    target = torch.zeros(h, n, dtype=torch.long, device=keys.device)
    block = max(1, BLOCK_ELEMENTS // max(1, h * n))
    for start in range(0, n, block):
        end = min(n, start + block)
        sim = torch.einsum("hbd,hnd->hbn", unit[:, start:end], unit)
        target[:, start:end] = sim.masked_fill(~keep.unsqueeze(1), float("-inf")).argmax(dim=-1)
    has_keep = keep.any(dim=1, keepdim=True)
    w_e = torch.where(evicted & has_keep, w, torch.zeros_like(w))
    absorbed.scatter_add_(1, target, w_e)
    num_k = torch.zeros_like(kf).scatter_add_(1, target.unsqueeze(-1).expand_as(kf), kf * w_e.unsqueeze(-1))
    num_v = torch.zeros_like(vf).scatter_add_(1, target.unsqueeze(-1).expand_as(vf), vf * w_e.unsqueeze(-1))
    den = w + absorbed
    change = keep & (absorbed > 0) & (den > 0)
    safe = torch.where(change, den, torch.ones_like(den)).unsqueeze(-1)
    merged_k = (kf * w.unsqueeze(-1) + num_k) / safe
    merged_v = (vf * w.unsqueeze(-1) + num_v) / safe
    out_k = torch.where(change.unsqueeze(-1), merged_k, kf)
    out_v = torch.where(change.unsqueeze(-1), merged_v, vf)
    return out_k, out_v, absorbed * keep
