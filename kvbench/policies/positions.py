"""``positions: reindex`` — StreamingLLM's positions within the cache, for RoPE models.

With ``absolute`` (the default) every kept key keeps the rotation of its true position and each new token
is fed at its true index. With ``reindex`` the cache's entries of each head are treated as one contiguous
run: the new tokens of a step are fed at positions P, P+1, … where P is the number of tokens held before
the step (the largest count over layers and heads, when layers or heads hold different counts), and each
head's kept keys are rotated to the positions P - len_h … P - 1 just before the new ones.

To keep that exact over any number of steps, a reindexing cache stores keys *un-rotated* (the rotation of
the position they were fed at is undone once, on write) and rotates them to their current positions when
the attention reads them; re-rotating stored keys in place every step would accumulate rounding error.
Only Llama-style RoPE (rotate-half, one static frequency table, possibly on a leading part of the head) is
supported; models without RoPE, or with dynamic/multiple RoPE tables, get a clear error.
"""
from __future__ import annotations

from typing import Any

import torch

UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


class Rotary:
    """Rotate vectors to (or back from) RoPE positions, with the model's frequency table."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.rot_dim = 2 * self.inv_freq.shape[0]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, D] rotated by ``positions`` [..., n] (negative positions undo a rotation)."""
        inv = self.inv_freq.to(x.device)
        angle = positions.to(torch.float32).unsqueeze(-1) * inv  # [..., n, rot/2]
        cos = torch.cat((angle.cos(), angle.cos()), dim=-1)
        sin = torch.cat((angle.sin(), angle.sin()), dim=-1)
        xr = x[..., : self.rot_dim].to(torch.float32)
        half = self.rot_dim // 2
        rotated_half = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        out = (xr * cos + rotated_half * sin).to(x.dtype)
        if self.rot_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., self.rot_dim :]), dim=-1)


def find_rotary(model: Any) -> Rotary:
    """The model's rotary embedding, or a ValueError saying why ``reindex`` cannot run on it."""
    found = []
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and "rotary" in type(module).__name__.lower():
            found.append(module)
    name = type(model).__name__
    if not found:
        raise ValueError(
            f"positions=reindex re-rotates kept keys with RoPE, but {name} has no rotary position embedding; "
            "use positions=absolute"
        )
    tables = {tuple(m.inv_freq.flatten().tolist()) for m in found}
    if len(tables) > 1:
        raise ValueError(f"positions=reindex supports one RoPE frequency table; {name} has {len(tables)}")
    rope_type = getattr(found[0], "rope_type", "default")
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        raise ValueError(f"positions=reindex needs a static RoPE; {name} uses rope_type={rope_type!r}")
    return Rotary(found[0].inv_freq)
