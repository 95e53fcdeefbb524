"""Prefill (optionally chunked) and a decode loop over a ``BudgetedCache``, with explicit positions.

The cache's length is never the sequence position: every fed token gets its true index in the
sequence, so kept keys keep their rotation and new ones are rotated where they really are.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.engine import measure
from kvbench.engine.attention import kvbench_attention_enabled
from kvbench.engine.cache import BudgetedCache
from kvbench.engine.fused_llama import FusedLlama, supports
from kvbench.engine.plan import plan_layers
from kvbench.engine.sampling import DecodeSettings, choose_token, cut_at_stop, eos_ids, hit_stop
from kvbench.families import check_supported, layer_windows
from kvbench.policies.base import Policy

STAGES = ("prefill", "decode", "both")


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str
    prompt_tokens: int
    budget_tokens: int | None
    kept_tokens: float
    seen_tokens: int
    budget_achieved: float
    budget_achieved_per_layer: list[float]
    kv_resident_bytes: int
    kv_resident_peak_bytes: int
    # Full-attention and sliding-window layers apart (None where the model has no layer of that kind).
    budget_achieved_full: float | None
    budget_achieved_sliding: float | None
    kv_resident_bytes_full: int | None
    kv_resident_bytes_sliding: int | None
    kv_capacity_bytes: int
    prefill_s: float
    ttft_s: float
    decode_latencies_s: list[float]
    peak_memory_prefill_bytes: int
    peak_memory_bytes: int
    peak_memory_kind: str
    logits: torch.Tensor | None = None
    trace: list[list[torch.Tensor]] | None = None

    def timings(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"prefill_s": self.prefill_s, "ttft_s": self.ttft_s}
        out["prefill_tokens_per_s"] = self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else None
        out.update(measure.latency_summary(self.decode_latencies_s))
        return out


def resolve_budget(budget: float | int, reference_length: int) -> int:
    """A fraction in (0, 1] of the reference length (rounded up) or an absolute token count."""
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget {budget} must be a fraction in (0, 1] or an integer token count >= 1")
        return max(1, math.ceil(budget * reference_length))
    if budget < 1:
        raise ValueError(f"budget {budget} must be a fraction in (0, 1] or an integer token count >= 1")
    return int(budget)


def reference_length(stage: str, context: int, suffix: int, max_new_tokens: int) -> int:
    """What a fractional budget is a fraction of: the prompt for prefill/both, the whole sequence for decode."""
    return context + suffix + max_new_tokens if stage == "decode" else context


def cache_argument(model: Any) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; accept either."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def fused_forward_for(model: Any, fused: bool | None) -> FusedLlama | None:
    """The model's fused forward, built once and kept on the model; None where it does not apply."""
    if fused is False:
        return None
    ok, why = supports(model)
    if not ok:
        if fused:
            raise ValueError(f"fused=true but {why}; use fused=false")
        return None
    key = (next(model.parameters()).device, next(model.parameters()).dtype)
    cached = getattr(model, "_kvbench_fused", None)
    if cached is None or cached[0] != key:
        cached = (key, FusedLlama(model))
        model._kvbench_fused = cached
    return cached[1]


def generate(*args: Any, **kwargs: Any) -> Generation:
    """Run one prompt through prefill and decode: ``generation``'s steps, to the end."""
    steps = generation(*args, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def generation(
    model: Any,
    tokenizer: Any,
    input_ids: list[int],
    policy: Policy,
    budget: float | int,
    stage: str = "prefill",
    settings: DecodeSettings | None = None,
    suffix_ids: list[int] | None = None,
    stride: int | None = None,
    return_logits: bool = False,
    trace: bool = False,
    forced_tokens: list[int] | None = None,
    replay_trace: list[list[torch.Tensor]] | None = None,
    fused: bool | None = None,
) -> Generator[None, None, Generation]:
    """Run one prompt through prefill and decode with ``policy`` holding ``budget`` in ``stage``, pausing
    (``yield``) once the prompt is in and after every decode step; the ``Generation`` is the return value.
    Pausing lets a benchmark interleave the decode steps of several runs, so that a slow spell of a shared
    machine lands on all of them alike (the device's peak-memory counters are then shared by those runs).

    ``suffix_ids`` are fed after the context is compressed (a question the policy must not see
    while compressing). The policy's allocation splits the budget across layers (see ``engine.plan`` for
    sliding-window layers). ``forced_tokens`` teacher-forces the decode (fidelity metrics).
    ``replay_trace`` (the ``trace`` of another run, used with the full cache) masks every step's
    past down to what that run held, which must give that run's logits. ``fused`` runs the forward
    with fused, pre-transposed projections (``None``: wherever the model supports it).
    """
    settings = settings or DecodeSettings()
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {STAGES}")
    suffix_ids = list(suffix_ids or [])
    device = next(model.parameters()).device
    context, suffix = len(input_ids), len(suffix_ids)
    if context < 1:
        raise ValueError("the prompt is empty")
    chunk = stride or context
    if chunk < 1:
        raise ValueError(f"stride {stride} must be >= 1")
    check_supported(model.config)
    windows = layer_windows(model.config)
    n_layers = len(windows)
    budget_tokens = (
        resolve_budget(budget, reference_length(stage, context, suffix, settings.max_new_tokens))
        if policy.evicts else None
    )
    if budget_tokens is not None and budget_tokens < policy.scope.min_budget():
        raise ValueError(
            f"budget of {budget_tokens} tokens is below what policy {policy.name!r} protects "
            f"({policy.scope.min_budget()} tokens); raise the budget or lower n_sink/window"
        )
    plans = plan_layers(policy, budget_tokens, windows, stage, context, suffix, settings.max_new_tokens, chunk)
    cache = BudgetedCache(plans, policy, seed=settings.seed, device=device, model=model)
    cache_kw = cache_argument(model)
    fused_forward = fused_forward_for(model, fused)
    sampler = torch.Generator(device=device)
    sampler.manual_seed(settings.seed)
    stops = eos_ids(model, tokenizer)
    traces: list[list[torch.Tensor]] = []
    logits_seen: list[torch.Tensor] = []
    resident_peak = 0

    n_forwards = 0

    def forward(ids: list[int], start: int, evicting: bool, phase: str) -> torch.Tensor:
        nonlocal resident_peak, n_forwards
        positions = torch.arange(start, start + len(ids), device=device)
        if replay_trace is not None and n_forwards > 0:
            for layer, held in zip(cache.layers, replay_trace[n_forwards - 1]):
                by_position = torch.zeros(held.shape[0], start, dtype=torch.bool, device=device)
                by_position.scatter_(1, held.to(device), True)
                # What this (full) cache holds, by position: everything, or a sliding layer's window.
                layer.visible_past = by_position.gather(1, layer.positions[:, : layer.length])
        n_forwards += 1
        # Statistics are collected while this step or a later one may evict (decode_evicts: the last to).
        fed_positions = cache.begin_step(positions, evicting, phase, collecting=decode_evicts)
        input_ids_t = torch.tensor([ids], device=device)
        if fused_forward is not None:
            logits = fused_forward(input_ids_t, fed_positions.unsqueeze(0), cache)
        else:
            logits = model(
                input_ids=input_ids_t,
                position_ids=fed_positions.unsqueeze(0),
                use_cache=True,
                logits_to_keep=1,
                kvbench_cache=cache,
                **{cache_kw: cache},
            ).logits[0, -1]
        resident_peak = max(resident_peak, cache.summary().resident_bytes)
        if trace:
            traces.append(cache.kept_positions())
        return logits

    prefill_evicts = stage in ("prefill", "both")
    decode_evicts = stage in ("decode", "both")
    with kvbench_attention_enabled(model):
        measure.reset_peak(device)
        t0 = measure.now(device)
        for start in range(0, context, chunk):
            logits = forward(input_ids[start : start + chunk], start, prefill_evicts, "prefill")
        kept_after_prefill = [layer.length for layer in cache.layers]
        if suffix:
            logits = forward(suffix_ids, context, False, "prefill")
        t_prefill = measure.now(device)
        token = int(choose_token(logits, settings, sampler)) if not forced_tokens else forced_tokens[0]
        t_first = measure.now(device)
        peak_prefill, peak_kind = measure.peak_memory_bytes(device)
        tokens = [token]
        if return_logits:
            logits_seen.append(logits.float().cpu())
        yield
        latencies: list[float] = []
        position = context + suffix
        stop_reason = "max_new_tokens"
        limit = len(forced_tokens) if forced_tokens else settings.max_new_tokens
        while len(tokens) < limit:
            if not forced_tokens and token in stops:
                stop_reason = "eos"
                break
            if not forced_tokens and settings.stop_strings and hit_stop(tokenizer, tokens, settings.stop_strings):
                stop_reason = "stop_string"
                break
            t_step = measure.now(device)
            logits = forward([token], position, decode_evicts, "decode")
            token = int(choose_token(logits, settings, sampler))
            if forced_tokens:
                token = forced_tokens[len(tokens)]
            latencies.append(measure.now(device) - t_step)
            position += 1
            tokens.append(token)
            if return_logits:
                logits_seen.append(logits.float().cpu())
            yield
        peak, _ = measure.peak_memory_bytes(device)

    summary = cache.summary()
    seen = position  # every token fed to the model
    kept = sum(summary.kept_per_layer) / n_layers
    if stage == "prefill":
        per_layer_achieved = [k / context for k in kept_after_prefill]
        achieved = sum(per_layer_achieved) / n_layers
    else:
        achieved = kept / seen
        per_layer_achieved = [k / seen for k in summary.kept_per_layer]
    by_kind = _by_layer_kind(windows, per_layer_achieved, summary.resident_per_layer)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    if stop_reason == "stop_string":
        text = cut_at_stop(text, settings.stop_strings)
    return Generation(
        tokens=tokens,
        text=text,
        stop_reason=stop_reason,
        prompt_tokens=context + suffix,
        budget_tokens=budget_tokens,
        kept_tokens=kept,
        seen_tokens=seen,
        budget_achieved=achieved,
        budget_achieved_per_layer=per_layer_achieved,
        kv_resident_bytes=summary.resident_bytes,
        kv_resident_peak_bytes=resident_peak,
        **by_kind,
        kv_capacity_bytes=summary.capacity_bytes,
        prefill_s=t_prefill - t0,
        ttft_s=t_first - t0,
        decode_latencies_s=latencies,
        peak_memory_prefill_bytes=peak_prefill,
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind,
        logits=torch.stack(logits_seen) if return_logits else None,
        trace=traces if trace else None,
    )


def _by_layer_kind(windows: list[int | None], achieved: list[float], resident: list[int]) -> dict[str, Any]:
    """Achieved budget (mean over layers) and resident bytes of the full-attention and the sliding layers."""
    out: dict[str, Any] = {}
    for kind, members in (("full", [w is None for w in windows]), ("sliding", [w is not None for w in windows])):
        chosen = [i for i, member in enumerate(members) if member]
        out[f"budget_achieved_{kind}"] = sum(achieved[i] for i in chosen) / len(chosen) if chosen else None
        out[f"kv_resident_bytes_{kind}"] = sum(resident[i] for i in chosen) if chosen else None
    return out
