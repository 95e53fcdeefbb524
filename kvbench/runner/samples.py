"""A prompt's samples (``sampling.n_samples``) made into one row: each sample scored on its own, the row's score and
metrics their means, pass@1 and pass@k beside them, and the generation lengths next to the full cache's.

One row per example, not per sample: the row is appended when all its samples are done, so a resumed cell never
holds part of a prompt's samples, and the report's means and paired intervals still resample examples, not
samples of the same prompt as if they were independent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.engine.engine import Generation
from kvbench.metrics.pass_at_k import PASS_AT_1, PASS_AT_K, pass_at_k
from kvbench.results.schema import Measures, Outcome
from kvbench.runner.passes import outcome
from kvbench.tasks.base import RenderedPrompt, Task


@dataclass
class Sample:
    """One sample of a prompt, scored."""

    generation: Generation
    prediction: str  # post-processed by the task
    metrics: dict[str, float]
    full_new_tokens: int | None  # the full cache's generated tokens for the same prompt and seed (None: unknown)
    reference: str | None = None  # the file name of that reference, when fidelity compared the two


def correct(score: float | None) -> bool:
    """A sample counts as correct for pass@k when its primary metric is full marks (1): meant for 0/1 metrics."""
    return score is not None and score >= 1.0


def kept_of_full(measures: Measures, full_new_tokens: float | None) -> float | None:
    """The budget in tokens as a share of the full cache's whole sequence (prompt + what it generated)."""
    if measures.budget_tokens is None or full_new_tokens is None:
        return None
    return measures.budget_tokens / (measures.prompt_tokens + full_new_tokens)


def mean_metrics(samples: list[Sample]) -> dict[str, float]:
    """Each metric's mean over the samples that have it."""
    names = dict.fromkeys(name for s in samples for name in s.metrics)
    return {
        name: sum(values) / len(values)
        for name in names
        if (values := [s.metrics[name] for s in samples if s.metrics.get(name) is not None])
    }


def combine(task: Task, prompt: RenderedPrompt, references: list[str], samples: list[Sample]) -> Outcome:
    """The row of a prompt's samples (in seed order). With one sample it is the sample's own row."""
    first, n = samples[0], len(samples)
    lengths = [s.generation.measures.new_tokens for s in samples]
    full = [s.full_new_tokens for s in samples]
    full_mean = None if any(f is None for f in full) else sum(f for f in full if f is not None) / n
    if n == 1:
        full_mean = full[0]
    fields: dict[str, Any] = {
        "prediction": first.prediction,
        "references": references,
        "fidelity_reference": first.reference,
        "fidelity_reference_tokens": first.full_new_tokens if first.reference else None,
        "new_tokens_mean": sum(lengths) / n,
        "full_new_tokens": full_mean,
        "kept_of_full": kept_of_full(first.generation.measures, full_mean),
    }
    metrics = first.metrics
    if n > 1:
        metrics = mean_metrics(samples)
        scores = [s.metrics.get(task.primary_metric) for s in samples]
        right = sum(correct(score) for score in scores)
        metrics[PASS_AT_1] = pass_at_k(n, right, 1)
        metrics[PASS_AT_K] = pass_at_k(n, right, n)
        fields.update(
            n_samples=n,
            sample_predictions=[s.prediction for s in samples],
            sample_scores=scores,
            sample_new_tokens=lengths,
            sample_full_new_tokens=full,
        )
    return outcome(task, metrics, first.generation, prompt, **fields)
