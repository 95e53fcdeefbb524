"""ROUGE for the summarisation tasks, via Google's ``rouge_score`` (what HF ``evaluate`` wraps).

F-measures with Porter stemming, in [0, 1]. ``rougeLsum`` takes newlines as sentence breaks and
texts are not re-split into sentences (that would need NLTK data, which cannot be fetched offline).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from rouge_score import rouge_scorer

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


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


def mean_scores(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over examples (a key missing from some rows is averaged over the rows that have it)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure alone, for tasks that report only that."""
    return rouge_scores(prediction, reference)["rougeL"]
