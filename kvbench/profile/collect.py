"""One forward over prompt + continuation with a profiling attention function: per layer, the attention profile
of the prompt's queries, the continuation's attention mass on the prompt, and the statistics the policies would
have read at the end of the prompt.

The family's attention semantics come from the engine: ``family_arguments`` refuses what kvbench does not
implement and hands over the sliding window and softcap, the output is the engine's blocked pass, and the
profile reads the same query blocks (``query_blocks``), masks (``visibility``) and softcapping. A block holds at
most about ``STATS_BLOCK_ELEMENTS`` probabilities: no n×n matrix is ever held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import AttentionInterface

from kvbench.engine.attention import family_arguments
from kvbench.engine.blocked import attention_statistics, query_blocks, softcapped
from kvbench.engine.score_inputs import ATTRIBUTES, attention_weights, projection
from kvbench.engine.visibility import KeyAccess, Window, visibility
from kvbench.families import layer_windows
from kvbench.policies.statistics import STATISTICS, Collecting, attention_names
from kvbench.profile import measures

PROFILE_ATTN = "kvbench_profile"


@dataclass
class PromptEnd:
    """What a layer's policy would see once the prompt is encoded: the engine's statistics over the prompt's
    queries, [H, P] (``qlog`` [H, history, P]), the prompt's keys and values [H, P, D], and the layer's weights a
    score may declare (``policies.inputs.WEIGHTS``: those the family's attention has)."""

    stats: dict[str, torch.Tensor]
    keys: torch.Tensor
    values: torch.Tensor
    window: int | None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class LayerProfile:
    """Sums over the prompt's queries per KV head (divide by ``queries``), and the continuation's mass on the
    prompt's keys summed over its queries (``future`` [H, P])."""

    queries: int
    entropy: torch.Tensor  # [H]
    sink: torch.Tensor  # [H]
    recent: torch.Tensor  # [H]
    coverage: torch.Tensor  # [levels, H]
    age: torch.Tensor  # [3, H, max_age]: count, sum, sum of squares (measures.age_moments)
    future: torch.Tensor  # [H, P]
    future_queries: int
    window: int | None


@dataclass
class Recorder:
    """Handed to the attention function through the model call. ``on_layer`` receives each layer's profile and
    prompt-end state as soon as the layer is done (so a layer's keys need not outlive it) and returns what to keep
    of it."""

    prompt_length: int
    windows: list[int | None]
    history: int
    max_age: int
    n_sink: int
    n_recent: int
    on_layer: Callable[[int, LayerProfile, PromptEnd], object]
    results: dict[int, object] = field(default_factory=dict)


def profile_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    recorder: Recorder = kwargs.pop("kvbench_profile")
    layer: int = module.layer_idx  # type: ignore[assignment]
    kwargs["dropout"] = dropout
    size, softcap = family_arguments(layer, kwargs, recorder.windows[layer])
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise RuntimeError("profiling runs one sequence in one forward, without a cache")
    n, p = key.shape[2], recorder.prompt_length
    access = KeyAccess(scaling, window=_window(size, n, key.device), softcap=softcap)
    output = attention_statistics(query, key, access, value=value)["output"]
    profile = _profile(query, key, access, p, recorder)
    end = attention_statistics(
        query[:, :, :p],
        key[:, :, :p],
        replace(access, window=_window(size, p, key.device)),
        Collecting(attention_names(STATISTICS), recorder.history),
    )
    weights = attention_weights(module, frozenset(n for n in ATTRIBUTES if projection(module, n) is not None))
    prompt_end = PromptEnd(end, key[0, :, :p], value[0, :, :p], size, weights)
    recorder.results[layer] = recorder.on_layer(layer, profile, prompt_end)
    return output, None


def _window(size: int | None, n: int, device: torch.device) -> Window | None:
    if size is None:
        return None
    positions = torch.arange(n, device=device).unsqueeze(0)
    return Window(size, positions, positions)


def _profile(
    query: torch.Tensor, key: torch.Tensor, access: KeyAccess, prompt: int, recorder: Recorder
) -> LayerProfile:
    """The profile sums, one block of queries at a time (probabilities in float32, reduced to KV heads)."""
    _, hq, n, _ = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    device = key.device
    window = access.window
    queries = query[0].to(torch.float32) * access.scaling
    keys = key[0].to(torch.float32).repeat_interleave(group, dim=0)
    levels = measures.COVERAGE_LEVELS
    sums = {name: torch.zeros(hkv, dtype=torch.float64, device=device) for name in ("entropy", "sink", "recent")}
    coverage = torch.zeros(len(levels), hkv, dtype=torch.float64, device=device)
    age = torch.zeros(3, hkv, recorder.max_age, dtype=torch.float64, device=device)
    future = torch.zeros(hkv, prompt, dtype=torch.float64, device=device)
    mean_row = torch.full((1, group), 1.0 / group, device=device)
    for start, end, lo in query_blocks(0, n, 0, n, hq, window):
        logits = softcapped(torch.matmul(queries[:, start:end], keys[:, lo:end].transpose(1, 2)), access.softcap)
        allowed = visibility(0, start, end, end, None, device, window, lo)[0]  # [rows, cols]
        probs = logits.masked_fill_(~allowed, float("-inf")).softmax(dim=-1)
        if group > 1:  # GQA: the group's mean, as a product (faster on CPU than a mean over the middle axis)
            probs = (mean_row @ probs.view(hkv, group, -1)).view(hkv, end - start, end - lo)
        split = min(max(prompt - start, 0), end - start)  # rows before it are the prompt's queries
        if split > 0:
            rows = probs[:, :split]
            q_pos = torch.arange(start, start + split, device=device)
            k_pos = torch.arange(lo, end, device=device)
            seen = allowed[:split]
            values, seen_age = measures.by_age(rows, q_pos, k_pos, seen, recorder.max_age)
            sums["entropy"] += measures.entropy(rows).sum(dim=-1)
            sums["sink"] += measures.mass_on(rows, measures.sink_keys(k_pos, recorder.n_sink)).sum(dim=-1)
            sums["recent"] += measures.recent_mass(values, recorder.n_recent).sum(dim=-1)
            coverage += measures.coverage_fractions(rows, seen.sum(dim=-1), levels).sum(dim=-1)
            age += measures.age_moments(values, seen_age)
        if split < end - start and lo < prompt:
            future[:, lo:] += probs[:, split:, : prompt - lo].sum(dim=1)
    return LayerProfile(
        queries=prompt,
        entropy=sums["entropy"],
        sink=sums["sink"],
        recent=sums["recent"],
        coverage=coverage,
        age=age,
        future=future,
        future_queries=n - prompt,
        window=None if window is None else window.size,
    )


AttentionInterface.register(PROFILE_ATTN, profile_attention)


@contextlib.contextmanager
def profiling_attention(model: Any) -> Iterator[None]:
    """Route the model's attention through the profiling function while active."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(PROFILE_ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def record(
    model: Any,
    prompt_ids: list[int],
    continuation_ids: list[int],
    on_layer: Callable[[int, LayerProfile, PromptEnd], object],
    history: int = 32,
    max_age: int = 1024,
    n_sink: int = measures.N_SINK,
    n_recent: int = measures.N_RECENT,
) -> dict[int, object]:
    """Run prompt + continuation through ``model`` once; ``on_layer``'s result per layer index."""
    if not prompt_ids or not continuation_ids:
        raise ValueError("profiling needs a non-empty prompt and a non-empty continuation")
    if not 1 <= n_recent <= max_age:
        raise ValueError(f"n_recent={n_recent} must be between 1 and max_age={max_age}")
    recorder = Recorder(len(prompt_ids), layer_windows(model.config), history, max_age, n_sink, n_recent, on_layer)
    ids = torch.tensor([prompt_ids + continuation_ids], device=next(model.parameters()).device)
    with profiling_attention(model):
        model(input_ids=ids, use_cache=False, logits_to_keep=1, kvbench_profile=recorder)
    return recorder.results
