"""RULER's two scores, x100 as RULER reports them: the share of the references the prediction contains
(``string_match_all``: every task but QA) and whether it contains any of them (``string_match_part``: QA, whose
references are alternative answers). Matching is case-insensitive substring search, as in RULER."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvbench.metrics.registry import metric_function

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """RULER's cleaning of a generation: control characters become newlines, the ends are stripped."""
    return _CONTROL.sub("\n", text.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[bool]:
    if not references:
        raise ValueError("a RULER example needs at least one reference")
    text = prediction.lower()
    return [reference.lower() in text for reference in references]


@metric_function(higher_is_better=True, label="string match, all references (x100)")
def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """100 x the share of the references found in the prediction."""
    found = _found(prediction, references)
    return 100.0 * sum(found) / len(found)


@metric_function(higher_is_better=True, label="string match, any reference (x100)")
def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """100 if any reference is found in the prediction, else 0."""
    return 100.0 * any(_found(prediction, references))
