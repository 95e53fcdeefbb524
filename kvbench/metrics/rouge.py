"""ROUGE for the summarisation tasks, via Google's ``rouge_score`` (what HF ``evaluate`` wraps).

F-measures with Porter stemming, in [0, 1]. ``rougeLsum`` takes newlines as sentence breaks and
texts are not re-split into sentences (that would need NLTK data, which cannot be fetched offline).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from rouge_score import rouge_scorer

from kvbench.metrics.registry import register_metric

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
for key, label in zip(ROUGE_KEYS, ("ROUGE-1", "ROUGE-2", "ROUGE-L", "ROUGE-Lsum")):
    register_metric(key, higher_is_better=True, label=label)


@lru_cache(maxsize=1)
def _scorer() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge_scores(prediction: str, references: str | Sequence[str]) -> dict[str, float]:
    """ROUGE F-measures of one prediction; with several references, the best one per key."""
    targets = [references] if isinstance(references, str) else list(references)
    if not targets:
        raise ValueError("ROUGE needs at least one reference")
    scores = _scorer().score_multi(targets, prediction)
    return {key: scores[key].fmeasure for key in ROUGE_KEYS}


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure alone, for tasks that report only that."""
    return rouge_scores(prediction, reference)["rougeL"]
