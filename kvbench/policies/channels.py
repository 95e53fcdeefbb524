"""Key-channel pruning (ThinK, Xu et al. 2024, arXiv:2407.21018): a cache keeps fewer channels of each key.

Once a prompt's context is in, each row (one layer's KV head) ranks the ``D`` channels of its keys by how much
they can add to a query-key product: the mean square of channel c over the context's last ``window`` queries
(after RoPE, averaged over the head's GQA group) times its mean square over the keys the row holds. The row keeps
its ``D - int(D · ratio)`` highest channels; its keys are stored with those channels only, later keys too, and each
query is narrowed to them before its product with the keys: the pruned channels count as zero. Values keep
every channel. A token policy chooses which entries a row keeps; this chooses which channels of their keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("think",)
CHANNEL_CHOICES = "null, or {kind: think, ratio: <share of key channels pruned, 0 <= ratio < 1>, window: <queries>}"


@dataclass(frozen=True)
class KeyChannels:
    """Prune the share ``ratio`` of each row's key channels, scored with the context's last ``window`` queries."""

    ratio: float
    window: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise ValueError(
                f"channels.ratio={self.ratio!r} must be at least 0 and below 1 (the share of key channels pruned; "
                "1 keeps no channel)"
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"channels.window={self.window!r} must be a positive integer (queries scored with)")

    def kept(self, dim: int) -> int:
        """Channels a row of ``dim``-channel keys keeps (kvpress prunes ``int(dim · ratio)``)."""
        return dim - int(dim * self.ratio)

    def scores(self, query_energy: torch.Tensor, key_energy: torch.Tensor) -> torch.Tensor:
        """Each channel's score [rows, D]: its mean square over the window's queries times over the held keys."""
        return query_energy.to(torch.float32) * key_energy.to(torch.float32)

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """The channels each row keeps, ascending, long [rows, kept]: the highest scores."""
        top = torch.topk(scores, self.kept(scores.shape[-1]), dim=-1).indices
        return top.sort(dim=-1).values


def build_channels(spec: Any) -> KeyChannels | None:
    """A policy's ``channels`` setting: null (every channel kept) or ``{kind: think, ratio, window}``."""
    if spec in (None, False, "none", "null"):
        return None
    if not (isinstance(spec, dict) or hasattr(spec, "items")):
        raise ValueError(f"channels={spec!r} must be {CHANNEL_CHOICES}")
    options = dict(spec)
    kind = options.pop("kind", "think")
    if kind not in KINDS:
        raise ValueError(f"channels.kind={kind!r} is unknown; choose one of {', '.join(KINDS)}")
    unknown = sorted(set(options) - {"ratio", "window"})
    if unknown:
        raise ValueError(f"channels has no option {', '.join(unknown)}; its options are kind, ratio, window")
    if "ratio" not in options:
        raise ValueError("channels needs option ratio (channels.ratio=0.5: the share of key channels pruned)")
    return KeyChannels(**options)
