"""LagKV (Liang et al. 2025): judge each block of the cache against the block after it, attention-free."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.grouped import depth_in_group
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("lagkv")
class LagKV(Score):
    """LagKV: after ``n_sink`` sinks, the held entries fall into lag blocks of ``lag_size`` positions. Each entry of
    a block is min/max-normalised per channel by the block that follows it (the lag reference), the standard
    deviation over its channels is taken (Bessel-corrected, as torch's ``std``), and a softmax over the block turns
    it into a share; an entry's score is the mean of its key's and its value's shares. Each block keeps its best
    entries: the entries rank by their depth in their own block (0 for a block's best), so every block keeps
    the same count (kvpress's rank within the block). The sinks, and the last full block with what follows it (the
    tail, which has no reference yet), are kept first: sinks, then the tail newest first. A cache too short for
    two blocks keeps its sinks and its newest entries. ``cross_scoring``: rank by the share itself across blocks
    (kvpress's experimental option) instead of by depth.

    Blocks are cut by absolute position, so a prompt fed at once is kvpress's LagKVPress exactly; a prompt fed in
    chunks, or a decode step, scores what each block still holds against what its next block still holds (the
    paper compresses in the decode stage too). Where kvpress leaves ties between blocks to ``topk`` (the same
    depth in several blocks, when the budget does not split evenly), the newer block keeps its entry. A block whose
    reference holds nothing (evicted whole at a tight budget), or whose reference has a constant channel, gets a
    spread of 0 where kvpress would get NaN."""

    def __init__(self, n_sink: int = 4, lag_size: int = 128, cross_scoring: bool = False):
        if int(n_sink) < 0:
            raise ValueError(f"lagkv n_sink={n_sink} must be >= 0")
        if int(lag_size) < 1:
            raise ValueError(f"lagkv lag_size={lag_size} must be at least 1 token")
        self.n_sink, self.lag_size, self.cross_scoring = int(n_sink), int(lag_size), bool(cross_scoring)

    def __call__(self, state: TokenState) -> torch.Tensor:
        valid = state.valid_mask()
        pos = state.positions
        newest = pos.masked_fill(~valid, -1).amax(dim=-1, keepdim=True)
        blocks = (newest + 1 - self.n_sink).clamp_min(0) // self.lag_size  # whole blocks after the sinks, [H, 1]
        block = (pos - self.n_sink).div(self.lag_size, rounding_mode="floor")
        sink = pos < self.n_sink
        scored = valid & ~sink & (block < blocks - 1)
        out = torch.where(sink, 3 + (self.n_sink - pos) / (self.n_sink + 1), 2 + (pos + 1) / (newest + 2))
        if not bool(scored.any()):
            return out.to(torch.float32)
        dummy = int(blocks.max()) + 1  # a slot for every entry that is neither scored nor a reference
        member = torch.where(valid & ~sink, block, dummy)
        ref = torch.where(scored, block + 1, dummy)
        group = torch.where(scored, block, dummy)
        share = (
            lag_share(state.keys, member, ref, group, dummy) + lag_share(state.values, member, ref, group, dummy)
        ) / 2
        if self.cross_scoring:
            return torch.where(scored, share, out).to(torch.float32)
        depth = depth_in_group(share, group, dummy).to(torch.float32)
        tie = (blocks - 1 - block) / blocks.clamp_min(1)  # at one depth, the older block's entry is evicted first
        return torch.where(scored, -(depth + tie), out).to(torch.float32)


def lag_share(
    x: torch.Tensor, member: torch.Tensor, ref: torch.Tensor, group: torch.Tensor, slots: int
) -> torch.Tensor:
    """Per entry, the softmax over its block (``group``) of the channel std of ``x`` [H, n, D] normalised by the
    min and max of the entries of block ``ref``; blocks are gathered by ``member``. Slot ``slots`` is a dump."""
    x = x.to(torch.float32)
    d = x.shape[-1]
    at = member.unsqueeze(-1).expand(-1, -1, d)
    shape = (x.shape[0], slots + 1, d)
    lo = torch.full(shape, float("inf"), device=x.device).scatter_reduce(1, at, x, "amin")
    hi = torch.full(shape, float("-inf"), device=x.device).scatter_reduce(1, at, x, "amax")
    by = ref.unsqueeze(-1).expand(-1, -1, d)
    lo, hi = lo.gather(1, by), hi.gather(1, by)
    spread = ((x - lo) / (hi - lo)).std(dim=-1).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return group_softmax(spread, group, slots)


def group_softmax(s: torch.Tensor, group: torch.Tensor, slots: int) -> torch.Tensor:
    """Softmax of ``s`` [H, n] within each group (slot ``slots``: left out, 0)."""
    inside = group < slots
    s = s.masked_fill(~inside, float("-inf"))
    top = torch.full((s.shape[0], slots + 1), float("-inf"), device=s.device).scatter_reduce(1, group, s, "amax")
    e = (s - top.gather(1, group)).exp().masked_fill(~inside, 0.0)
    total = torch.zeros_like(top).scatter_add(1, group, e)
    return e / total.gather(1, group).clamp_min(1e-30)
