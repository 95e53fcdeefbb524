"""SnapKV's observation window."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.derived import logged_sum
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("snapkv")
class SnapKV(Score):
    """SnapKV: the attention the last ``window`` queries (the observation window) paid each earlier entry, summed
    over those queries, then pooled over neighbouring held entries (1-D ``pooling`` "avg" or "max" with an odd
    ``kernel_size``, stride 1) so that a kept token brings its neighbourhood.

    The window is the layer's query log: the last ``window`` tokens fed, prompt and decode alike, so with a
    chunked prompt it still spans the last ``window`` prompt queries across chunks. Its own entries are those
    with ``count <= window`` (tokens fed since the entry, itself included), found by ``count`` and not by index:
    a head need not hold all of them, nor hold them last. As in SnapKV's reference and kvpress, the pooling stops
    at the window: the entries before it (the prefix) are pooled as avg_pool1d (zero padding counted) or
    max_pool1d (-inf padding) of the prefix alone would pool them, so the window's attention to itself never
    spills into the entries next to it. The window's entries are not pooled: they score their own summed
    attention. SnapKV always keeps them; here the scope protects them (configs/policy/snapkv.yaml), so their
    scores only matter under a scope that does not. Padding entries (per-head allocation, padded stacks) hold
    zero statistics and pool with the prefix, as zeros, as before. Needs a prompt: refused in stage=decode.

    ``window_score: top`` scores the window's entries as kvpress's SnapKVPress does, for a score built on this
    one that ranks them with the rest (kvpress's ChunkKV): above every prefix entry, at the prefix's best score
    over the layer's heads plus one query's full attention (kvpress's mean over the window's queries, plus 1,
    on this sum: the best plus ``window``). ``own`` (the default): their own summed attention.
    """

    needs = frozenset({"qlog", "count"})
    unsupported_stages: tuple[str, ...] = ("decode",)
    why_unsupported = "SnapKV scores the prompt from its observation window and compresses the prompt only"

    def __init__(self, window: int = 32, kernel_size: int = 7, pooling: str = "avg", window_score: str = "own"):
        if int(window) < 1:
            raise ValueError(f"window={window} must be >= 1 query")
        if int(kernel_size) < 1 or int(kernel_size) % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size} must be a positive odd number")
        if pooling not in ("avg", "max"):
            raise ValueError(f"pooling={pooling!r} must be 'avg' or 'max'")
        if window_score not in ("own", "top"):
            raise ValueError(f"window_score={window_score!r} must be 'own' or 'top'")
        self.history = int(window)
        self.window = int(window)
        self.kernel_size = int(kernel_size)
        self.pooling = pooling
        self.window_score = window_score

    def in_window(self, state: TokenState) -> torch.Tensor:
        """Bool [H, n]: the entries of the last ``window`` tokens fed (never padding). A state without ``count``
        (one built by hand) takes each head's newest held entry as the last token fed."""
        if "count" in state.stats:
            count = state.stats["count"]
        else:
            newest = state.positions if state.valid is None else state.positions.masked_fill(~state.valid, -1)
            count = newest.amax(dim=-1, keepdim=True) + 1 - state.positions
        window = count <= self.window
        return window if state.valid is None else window & state.valid

    def __call__(self, state: TokenState) -> torch.Tensor:
        window = self.in_window(state)
        pooled = pool_neighbours(logged_sum(state), self.kernel_size, self.pooling, window)
        if self.window_score == "own":
            return pooled
        prefix = pooled.masked_fill(window | ~state.valid_mask(), float("-inf"))
        best = state.per_unit(prefix).flatten(1).amax(dim=1)  # per (layer, sequence)
        best = best.nan_to_num(neginf=0.0) + self.window  # no prefix (a short row): the window alone
        top = best.repeat_interleave(state.heads // state.units).unsqueeze(1).expand_as(pooled)
        return torch.where(window, top, pooled)


def pool_neighbours(
    scores: torch.Tensor, kernel_size: int, pooling: str, window: torch.Tensor | None = None
) -> torch.Tensor:
    """1-D pooling along the token axis, same length out: [H, n] -> [H, n]. What SnapKV's avg_pool1d (zero
    padding counted) or max_pool1d computes, as ``kernel_size`` shifted adds (or maxima) of a padded copy: several
    times faster than the pooling kernels on a [heads, n] matrix.

    ``window`` (bool [H, n]): entries left out of the pooling. The others read them as padding (0 for avg, -inf
    for max), so that entries before a window at a row's end get exactly the pooling of that prefix alone; the
    window's entries keep their own ``scores``, unpooled. ``scores`` is never written."""
    if kernel_size == 1:
        return scores
    pad, n = kernel_size // 2, scores.shape[-1]
    fill = 0.0 if pooling == "avg" else float("-inf")
    padded = F.pad(scores, (pad, pad), value=fill)
    if window is not None:
        padded[:, pad : pad + n].masked_fill_(window, fill)
    out = (
        padded[:, :n] + padded[:, 1 : n + 1] if pooling == "avg" else torch.maximum(padded[:, :n], padded[:, 1 : n + 1])
    )
    for i in range(2, kernel_size):
        if pooling == "avg":
            out += padded[:, i : i + n]
        else:
            torch.maximum(out, padded[:, i : i + n], out=out)
    if pooling == "avg":
        out /= kernel_size
    return out if window is None else torch.where(window, scores, out)
