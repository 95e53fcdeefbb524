"""A model's per-head query statistics before RoPE (TriAttention's calibration): what the file holds, how it is
read and written, and whether it belongs to a model, which is told from the model's config alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.policies.positions import Rotary


@dataclass
class QueryCentres:
    """Per layer and query head: ``centre`` [layers, heads, D], the mean query before RoPE; ``pair_norm``
    [layers, heads, rot/2], the mean modulus of each rotated pair (the layer's RoPE pairs, in its layout). ``model``:
    what the queries came from (``describe``), ``tokens``: how many calibration tokens were averaged."""

    centre: torch.Tensor
    pair_norm: torch.Tensor
    model: dict[str, Any]
    tokens: int

    def save(self, path: str | Path) -> None:
        meta = json.dumps({"model": self.model, "tokens": self.tokens})
        with open(path, "wb") as f:  # a file object: np.savez would append .npz to a bare name
            np.savez(f, centre=self.centre.numpy(), pair_norm=self.pair_norm.numpy(), meta=np.array(meta))

    @classmethod
    def load(cls, path: str | Path) -> QueryCentres:
        with np.load(path) as got:
            meta = json.loads(str(got["meta"]))
            centre, pair_norm = torch.from_numpy(got["centre"]), torch.from_numpy(got["pair_norm"])
        return cls(centre, pair_norm, meta["model"], meta["tokens"])

    def mismatch(self, config: Any) -> str | None:
        """How the model of ``config`` differs from the calibration's (one clause), or None."""
        want = describe(config)
        differ = [
            f"{k} {self.model.get(k)!r} here, {v!r} in the model" for k, v in want.items() if self.model.get(k) != v
        ]
        return "; ".join(differ) or None


def describe(config: Any) -> dict[str, Any]:
    """What a calibration must share with the model it scores: its family, shapes and RoPE (from the config; two
    models alike in all of these, a model and its fine-tune, cannot be told apart without weights)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return {
        "model_type": str(text.model_type),
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
        "layers": int(text.num_hidden_layers),
        "heads": heads,
        "kv_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        "rope": json.loads(json.dumps(rope, sort_keys=True, default=str)),
    }


def pair_moduli(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """|x_f| of each rotated pair of ``x`` [..., D], paired as ``rotary``'s layout pairs them: [..., rot/2]."""
    xr = x[..., : rotary.rot_dim].to(torch.float32)
    if rotary.layout == "half":
        half = rotary.rot_dim // 2
        a, b = xr[..., :half], xr[..., half:]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
    return torch.sqrt(a * a + b * b)
