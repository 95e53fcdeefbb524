"""NumPy references for the linear-algebra scores (leverage, CUR, CAP, non-causal attention, Compactor), written
from the papers' and kvpress's equations, one row (KV head) at a time with plain loops, and a recorder of what
the tiny model itself projected and rotated. Nothing here calls kvbench."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from engine_run import generate
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.engine.engine import DecodeSettings


def np_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Llama's rotate-half RoPE of x [..., n, D] at positions [n] (or broadcastable)."""
    angle = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_zscore(rows: list[np.ndarray]) -> list[np.ndarray]:
    """Each row standardised by the mean and the (n − 1) standard deviation of all the rows' entries together."""
    every = np.concatenate(rows)
    mean, std = every.mean(), max(every.std(ddof=1), 1e-6)
    return [(r - mean) / std for r in rows]


def np_leverage(keys: np.ndarray, sketch: np.ndarray, ridge: float = 1e-2) -> np.ndarray:
    """xᵢᵀ (XᵀX + λI)⁻¹ xᵢ with X = (K − mean K) Φ, keys [n, D], Φ [D, k]."""
    x = (keys - keys.mean(axis=0)) @ sketch
    inverse = np.linalg.inv(x.T @ x + ridge * np.eye(x.shape[1]))
    return np.array([max(float(row @ inverse @ row), 0.0) for row in x])


def np_cur(keys: np.ndarray, values: np.ndarray, window: int = 16, how: str = "kv_product") -> np.ndarray:
    """CurDKV's scores of one row: squared norms as shares of blocks of ``window``, combined, as a share."""

    def local(x: np.ndarray) -> np.ndarray:
        if window == 0:
            return x
        out = np.empty_like(x)
        for start in range(0, len(x), window):
            out[start : start + window] = x[start : start + window] / x[start : start + window].sum()
        return out

    k2, v2 = local((keys**2).sum(axis=1)), local((values**2).sum(axis=1))
    scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[how]
    return scores / scores.sum()


def np_noncausal(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, chunk: int) -> np.ndarray:
    """One KV head: queries [group, n, D], keys and values [n, D]. Chunks of ``chunk`` tokens (the last filled
    with zero queries and keys), softmax(q kᵀ) within each, summed over its queries, mean over the group, times
    ‖v‖₂, then the mean of each score and its two neighbours (zeros beyond the ends)."""
    group, n, dim = queries.shape
    padded = -(-n // chunk) * chunk
    q = np.zeros((group, padded, dim))
    q[:, :n] = queries
    k = np.zeros((padded, dim))
    k[:n] = keys
    received = np.zeros(padded)
    for h in range(group):
        for start in range(0, padded, chunk):
            logits = q[h, start : start + chunk] @ k[start : start + chunk].T
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            received[start : start + chunk] += probs.sum(axis=0) / group
    scores = received[:n] * np.linalg.norm(values, axis=1)
    edged = np.concatenate([[0.0], scores, [0.0]])
    return (edged[:-2] + edged[1:-1] + edged[2:]) / 3


def np_mean_rotation(dim: int, first: int, count: int, inv_freq: np.ndarray) -> np.ndarray:
    """The RoPE rotation matrix averaged over positions first … first + count − 1, [D, D]."""
    eye = np.eye(dim)
    return np.mean([np_rope(eye, np.full(dim, p), inv_freq).T for p in range(first, first + count)], axis=0)


def np_cap(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    rotation: np.ndarray,
    tau: float = 5.0,
    n_sink: int = 4,
    eps: float = 1e-6,
) -> np.ndarray:
    """CAPKV on one KV head past its sinks: queries before RoPE [group, n, D], keys after RoPE and values [n, D],
    ``rotation`` the mean future RoPE matrix. Per query head h: μ = mean of R̄q, wᵢ = exp(τ cos(kᵢ, μ) − max),
    A = I + Σ (wᵢ + ε) vᵢvᵢᵀ, sᵢ = wᵢ vᵢᵀA⁻¹vᵢ; the mean over the group. [n − n_sink]."""
    k, v = keys[n_sink:], values[n_sink:]
    out = np.zeros(len(k))
    for h in range(queries.shape[0]):
        anchor = np.mean([rotation @ q for q in queries[h, n_sink:]], axis=0)
        cosine = np.clip(k @ anchor / np.linalg.norm(k, axis=1) / np.linalg.norm(anchor), -1, 1)
        w = np.exp(tau * cosine - np.max(tau * cosine))
        capacity = np.eye(v.shape[1]) + sum((wi + eps) * np.outer(vi, vi) for wi, vi in zip(w, v))
        inverse = np.linalg.inv(capacity)
        out += np.array([wi * vi @ inverse @ vi for wi, vi in zip(w, v)]) / queries.shape[0]
    return out


class Projections:
    """Per layer, what the model's attention projected at each forward (q, k, v before RoPE, [heads, q, D]) and
    the (cos, sin) it rotated with."""

    def __init__(self, model: torch.nn.Module):
        self.model, layers = model, model.model.layers
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.projected: list[dict[str, list[torch.Tensor]]] = [{"q": [], "k": [], "v": []} for _ in layers]
        self.rotations: list[list] = [[] for _ in layers]
        self.handles = []
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            for name in ("q", "k", "v"):
                self.handles.append(
                    getattr(attn, f"{name}_proj").register_forward_hook(
                        lambda m, i, out, at=index, what=name: self.projected[at][what].append(out.detach()[0])
                    )
                )
            self.handles.append(
                attn.register_forward_pre_hook(
                    lambda m, a, kw, at=index: self.rotations[at].append(kw["position_embeddings"]), with_kwargs=True
                )
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def run(self, policy: Any, ids: list[int], budget: float, stage: str, new_tokens: int, stride: int | None = None):
        """The engine on ``ids`` under ``policy`` (unfused, so scores see every eviction), recording; the hooks
        are removed afterwards whatever happens."""
        try:
            settings = DecodeSettings(max_new_tokens=new_tokens)
            generate(self.model, None, ids, policy, budget, stage, settings, stride=stride, fused=False)
        finally:
            self.remove()

    def before_rope(self, layer: int, what: str) -> np.ndarray:
        """Every forward's q, k or v of ``layer`` in sequence order, [heads, positions, D]."""
        out = torch.cat(self.projected[layer][what])  # [positions, heads × D]
        heads = self.heads if what == "q" else self.kv_heads
        return out.view(out.shape[0], heads, -1).transpose(0, 1).double().numpy()

    def after_rope(self, layer: int, what: str) -> np.ndarray:
        """Every forward's q or k of ``layer`` after the model's own RoPE, in sequence order, [heads, positions, D]."""
        heads = self.heads if what == "q" else self.kv_heads
        out = []
        for x, (cos, sin) in zip(self.projected[layer][what], self.rotations[layer]):
            x = x.view(x.shape[0], heads, -1).transpose(0, 1).unsqueeze(0)
            out.append(apply_rotary_pos_emb(x, x, cos, sin)[0][0])
        return torch.cat(out, dim=1).double().numpy()
