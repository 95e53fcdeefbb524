"""CurDKV's CUR leverage of keys and values (kvpress's CURPress)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState

COMBINATIONS = ("key", "value", "kv_avg", "kv_product")


@register_score("cur")
class CUR(Score):
    """CUR leverage (CurDKV): a token's squared key norm and squared value norm, each as its share of a local
    window (blocks of ``local_window`` consecutive held entries, from each row's first; 0: no windows), combined
    by ``leverage`` (``kv_product``: their product; ``kv_avg``: their mean; ``key`` or ``value`` alone), then as a
    share of the row's total. kvpress's CURPress with its defaults; the attention sinks it scores 1 are the
    scope's (configs/policy/cur.yaml). Its random projection of keys and values (off by default) is not offered:
    the norms are computed once, when an entry is written. Needs no query, so it runs in every stage: in decode
    the windows are counted over the entries a row still holds."""

    feature_names = frozenset({"key_sq", "value_sq"})

    def __init__(self, leverage: str = "kv_product", local_window: int = 16):
        if leverage not in COMBINATIONS:
            raise ValueError(f"leverage={leverage!r} must be one of {', '.join(COMBINATIONS)}")
        if int(local_window) < 0:
            raise ValueError(f"local_window={local_window} must be >= 0 (0: no local windows)")
        self.leverage, self.local_window = leverage, int(local_window)

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {
            "key_sq": keys.to(torch.float32).pow(2).sum(dim=-1),
            "value_sq": values.to(torch.float32).pow(2).sum(dim=-1),
        }

    def __call__(self, view: TokenState) -> torch.Tensor:
        k2, v2 = (local_shares(view.stats[name], self.local_window) for name in ("key_sq", "value_sq"))
        if self.leverage == "key":
            scores = k2
        elif self.leverage == "value":
            scores = v2
        elif self.leverage == "kv_avg":
            scores = (k2 + v2) / 2
        else:
            scores = k2 * v2
        return scores / view.sum(scores).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)


def local_shares(x: torch.Tensor, window: int) -> torch.Tensor:
    """x [rows, n] >= 0, each entry as its share of its block of ``window`` entries (the last block may be short;
    padding, zero, adds nothing); ``window`` 0: x itself."""
    if window == 0:
        return x
    rows, n = x.shape
    blocks = F.pad(x, (0, -n % window)).view(rows, -1, window)
    shares = blocks / blocks.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return shares.view(rows, -1)[:, :n]
