"""The run's policy over one prompt, exactly as a timed run does it, and what the engine measured as a row's
fields. Generation, teacher forcing for fidelity, and perplexity all go through here."""

from __future__ import annotations

from typing import Any

from kvbench.config import RunSpec
from kvbench.engine import measure
from kvbench.engine.generate import DecodeSettings, Generation, generate
from kvbench.models import LoadedModel
from kvbench.results.schema import Measures, Timings
from kvbench.tasks.base import Example, RenderedPrompt, Task


def example_settings(task: Task, spec: RunSpec, ex: Example) -> DecodeSettings:
    """The task's settings for the example, with the run's overrides (max_new_tokens, sampling, seed)."""
    settings = task.generation(ex)
    return spec.decode_settings(settings.max_new_tokens, settings.stop_strings)


def policy_pass(
    lm: LoadedModel, spec: RunSpec, prompt: RenderedPrompt, settings: DecodeSettings, **extra: Any
) -> Generation:
    """``generate`` under the run's policy, budget, stage and prefill chunk; ``extra`` for teacher forcing."""
    return generate(
        lm.model,
        lm.tokenizer,
        prompt.input_ids,
        spec.policy,
        spec.budget,
        spec.stage,
        settings,
        suffix_ids=prompt.suffix_ids,
        stride=spec.stride,
        **extra,
    )


def measures(g: Generation) -> Measures:
    """A generation's budget, cache, memory, time and length fields."""
    return Measures(
        budget_tokens=g.budget_tokens,
        budget_achieved=g.budget_achieved,
        budget_achieved_per_layer=g.budget_achieved_per_layer,
        kept_tokens=g.kept_tokens,
        seen_tokens=g.seen_tokens,
        kv_resident_bytes=g.kv_resident_bytes,
        kv_resident_peak_bytes=g.kv_resident_peak_bytes,
        budget_achieved_full=g.budget_achieved_full,
        budget_achieved_sliding=g.budget_achieved_sliding,
        kv_resident_bytes_full=g.kv_resident_bytes_full,
        kv_resident_bytes_sliding=g.kv_resident_bytes_sliding,
        kv_capacity_bytes=g.kv_capacity_bytes,
        peak_memory_prefill_bytes=g.peak_memory_prefill_bytes,
        peak_memory_bytes=g.peak_memory_bytes,
        peak_memory_kind=g.peak_memory_kind,
        timings=timings(g),
        prompt_tokens=g.prompt_tokens,
        new_tokens=len(g.tokens),
        stop_reason=g.stop_reason,
    )


def timings(g: Generation) -> Timings:
    """A generation's timings: its prefill, its decode steps' latency, and the batch it shared them with."""
    latency = measure.latency_summary(g.decode_latencies_s)
    steps, sizes = sum(g.decode_latencies_s), g.decode_batch_sizes
    return Timings(
        prefill_s=g.prefill_s,
        ttft_s=g.ttft_s,
        prefill_tokens_per_s=g.prompt_tokens / g.prefill_s if g.prefill_s > 0 else None,
        decode_ms_mean=latency.mean_ms,
        decode_ms_p50=latency.p50_ms,
        decode_ms_p95=latency.p95_ms,
        decode_tokens_per_s=latency.per_s,
        batch_decode_tokens_per_s=sum(sizes) / steps if steps > 0 else None,
        decode_batch_mean=sum(sizes) / len(sizes) if sizes else None,
    )
