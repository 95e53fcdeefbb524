"""Importance scores. Each maps a layer's ``TokenState`` to a float [kv_heads, n]; higher survives.

Attention statistics (``acc``, ``sumsq``, ``count``, ``last``, ``qlog``) are collected by the engine's
attention function. Grouped-query attention: a statistic is first computed per *query* head, then the
query heads of a group are reduced to their KV head by the MEAN of their attention probabilities
(engine.attention.attention_statistics), so every score here is per KV head, the unit the cache stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.policies.base import Score
from kvbench.policies.state import TokenState


class Recency(Score):
    """Newer tokens matter more: the score is the absolute position (StreamingLLM, sliding window)."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.positions.to(torch.float32)


class RandomScore(Score):
    """Uniform random scores: evicts a uniformly random subset, drawn afresh at every step.

    An entry's draw is a hash of the run's seed, its row (layer and KV head), its position and the tokens fed so
    far, so it does not depend on which other rows or sequences are scored with it: a sequence evicts the same
    entries alone or in any batch."""

    def __call__(self, state: TokenState) -> torch.Tensor:
        return uniform_hash(state.seed, state.row_keys, state.positions, state.seen)


def uniform_hash(
    seed: int, rows: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor | int | None
) -> torch.Tensor:
    """Floats in [0, 1) from integer inputs (murmur3's 32-bit finaliser over a mix of them), [rows, n]."""
    mask = 0xFFFFFFFF
    seen = torch.as_tensor(0 if seen is None else seen, device=positions.device)
    x = (positions * 2654435761) & mask
    x = x ^ ((rows * 2246822519) & mask) ^ ((seen * 3266489917) & mask) ^ ((int(seed) * 668265263) & mask)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> shift)) * mult) & mask
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) / float(1 << 24)


class Accumulated(Score):
    """H2O's heavy hitters: the attention probability a token received, summed over every query that saw it."""

    needs = frozenset({"acc"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.stats["acc"]


def attention_mean_std(stats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: mean and (population) standard deviation of the attention probabilities it received.

    Over the ``count`` queries that could see the token (each query at or after it, while it was held):
    mean = acc / count, std = sqrt(sumsq / count - mean²). A token no query has seen yet scores 0.
    """
    mean = stats["acc"] / stats["count"].clamp_min(1.0)
    return mean, attention_std(stats, mean)


def attention_std(stats: dict[str, torch.Tensor], mean: torch.Tensor) -> torch.Tensor:
    var = (stats["sumsq"] / stats["count"].clamp_min(1.0) - mean.square()).clamp_min(0.0)
    return var.sqrt()


def clamped_count(state: TokenState) -> torch.Tensor:
    """``count`` floored at 1 (a token no query has seen yet scores 0), computed once per state."""
    return state.derived("count_min1", lambda s: s.stats["count"].clamp_min(1.0))


def mean_attention(state: TokenState) -> torch.Tensor:
    """``attention_mean_std``'s mean, computed once per state."""
    return state.derived("mean", lambda s: s.stats["acc"] / clamped_count(s))


def attention_variance(state: TokenState) -> torch.Tensor:
    """The square of ``attention_mean_std``'s deviation, computed once per state on the shared mean. It ranks
    tokens as the deviation does (the square root is increasing), so ranking needs no root: E[a²] - mean²,
    which rounding may leave a hair below 0 for a token of (near) constant attention."""
    return state.derived(
        "var",
        lambda s: torch.addcmul(s.stats["sumsq"] / clamped_count(s), mean_attention(s), mean_attention(s), value=-1.0),
    )


def logged_sum(state: TokenState) -> torch.Tensor:
    """The query log summed over its rows, [H, n]: all that hit counts and SnapKV read of it."""
    return state.derived("qlog_sum", lambda s: s.stats["qlog"].sum(dim=1))


class MeanAttention(Score):
    """RoCo's mean attention: accumulated attention divided by the number of queries that attended the token,
    so old tokens are not favoured just for having been seen by more queries."""

    needs = frozenset({"acc", "count"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return mean_attention(state)


class LastQuery(Score):
    """TOVA: the attention probability from the most recent query only."""

    needs = frozenset({"last"})

    def __call__(self, state: TokenState) -> torch.Tensor:
        return state.stats["last"]


class Hits(Score):
    """ScissorHands' persistence of importance, as a hit count over a history window.

    Let the layer's query log hold the last ``history`` queries it processed (one query per fed token,
    prefill and decode alike, oldest dropped first). Query i *hits* held token j when j was visible to i
    and the (GQA group-mean) attention probability a_ij >= threshold / n_i, where n_i is the number of
    entries query i could see: ``threshold = 1`` means "at least the uniform share", ScissorHands' average
    attention 1/t. The score of j is its number of hits; tokens that keep being important have the most.
    The log keeps each query's hit indicators (``log_rows``), decided once when the query is logged.
    (ScissorHands counts the complementary "below average" events and evicts the largest counts; counting
    hits differs only for tokens younger than the window, which scopes protect as its recent window.)
    """

    needs = frozenset({"qlog"})

    def __init__(self, history: int = 32, threshold: float = 1.0):
        if int(history) < 1:
            raise ValueError(f"history={history} must be >= 1 query")
        if float(threshold) <= 0:
            raise ValueError(f"threshold={threshold} must be > 0 (a multiple of the uniform share 1/n)")
        self.history = int(history)
        self.threshold = float(threshold)

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        bar = self.threshold / nvis.clamp_min(1.0)  # > 0, so a key a query did not see (0) never hits
        return (probs >= bar.unsqueeze(-1)).to(torch.float32)

    def __call__(self, state: TokenState) -> torch.Tensor:
        return logged_sum(state)


class ObservationWindow(Score):
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
    """

    needs = frozenset({"qlog", "count"})
    unsupported_stages = ("decode",)
    why_unsupported = "SnapKV scores the prompt from its observation window and compresses the prompt only"

    def __init__(self, window: int = 32, kernel_size: int = 7, pooling: str = "avg"):
        if int(window) < 1:
            raise ValueError(f"window={window} must be >= 1 query")
        if int(kernel_size) < 1 or int(kernel_size) % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size} must be a positive odd number")
        if pooling not in ("avg", "max"):
            raise ValueError(f"pooling={pooling!r} must be 'avg' or 'max'")
        self.history = int(window)
        self.window = int(window)
        self.kernel_size = int(kernel_size)
        self.pooling = pooling

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
        summed = logged_sum(state)
        if self.kernel_size == 1:
            return summed
        return pool_neighbours(summed, self.kernel_size, self.pooling, self.in_window(state))


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


class KeyNorm(Score):
    """Keys with a LOWER L2 norm are kept (Devoto et al.: low key norm goes with high attention). Free: no
    attention needed. RoPE is a rotation, so the norm of a rotated key is the norm of the raw key; it is
    taken once, when the key is written."""

    feature_names = frozenset({"key_norm"})

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"key_norm": keys.to(torch.float32).norm(dim=-1)}

    def __call__(self, state: TokenState) -> torch.Tensor:
        return -state.stats["key_norm"]


class ValueAware(Score):
    """VATP: attention × value norm. ``base`` is an attention score (accumulated by default), multiplied by
    the ``p``-norm of the token's value vector (VATP uses the L1 norm), taken once when the value is written."""

    def __init__(self, base: str = "accumulated", p: float = 1.0):
        if base not in SCORES or base == "value_aware":
            raise ValueError(
                f"value_aware base {base!r} must be another score: {sorted(set(SCORES) - {'value_aware'})}"
            )
        self.base = SCORES[base]()
        self.p = float(p)
        self.needs = self.base.needs
        self.history = self.base.history
        self.unsupported_stages = self.base.unsupported_stages
        self.why_unsupported = self.base.why_unsupported
        self.feature_names = self.base.feature_names | {"value_norm"}

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.base.features(keys, values) | {"value_norm": values.to(torch.float32).norm(p=self.p, dim=-1)}

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        return self.base.log_rows(probs, nvis)

    def __call__(self, state: TokenState) -> torch.Tensor:
        return self.base(state) * state.stats["value_norm"]


class SharedAcrossHeads(Score):
    """One kept set per layer: the inner score averaged over the layer's KV heads (TOVA's layer-wise choice).
    Needs heads sharing one length (uniform allocation)."""

    def __init__(self, inner: Score):
        self.inner = inner
        self.needs = inner.needs
        self.history = inner.history
        self.unsupported_stages = inner.unsupported_stages
        self.why_unsupported = inner.why_unsupported
        self.feature_names = inner.feature_names

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.features(keys, values)

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        return self.inner.log_rows(probs, nvis)

    def __call__(self, state: TokenState) -> torch.Tensor:
        if state.valid is not None:
            raise ValueError("shared: true needs heads holding the same tokens; it cannot run with per-head allocation")
        scores = self.inner(state).to(torch.float32)
        per_layer = scores.reshape(state.units, -1, scores.shape[-1])  # each (layer, sequence) chooses its own
        return per_layer.mean(dim=1, keepdim=True).expand_as(per_layer).reshape(scores.shape)


SCORES: dict[str, type[Score]] = {
    "recency": Recency,
    "random": RandomScore,
    "accumulated": Accumulated,
    "mean": MeanAttention,
    "last": LastQuery,
    "hits": Hits,
    "snapkv": ObservationWindow,
    "key_norm": KeyNorm,
    "value_aware": ValueAware,
}
