"""The task contract: where examples come from, how they become prompt ids, how predictions are scored.

A task knows nothing about caches or policies; the runner hands it a tokenizer and takes back
token ids, then hands it the generated text and takes back a dict of metric values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    """One evaluation item. ``references`` may be empty (fidelity-only tasks)."""

    id: str
    prompt: str
    references: list[str] = field(default_factory=list)
    # Text appended after the compressed context when a task splits context and question
    # (``question_aware=false``); empty when the whole prompt is compressed together.
    question: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RenderedPrompt:
    """Token ids ready for the engine. ``suffix_ids`` are fed after the context is compressed."""

    input_ids: list[int]
    suffix_ids: list[int] = field(default_factory=list)
    truncated: bool = False
    n_prompt_tokens_raw: int = 0


@dataclass
class GenerationSettings:
    """What a task asks of the decoder; the run config may override ``max_new_tokens``."""

    max_new_tokens: int = 32
    # Extra strings that end generation (LongBench's newline for samsum, for example).
    stop_strings: list[str] = field(default_factory=list)


class Task(ABC):
    """Base class of every task. Subclasses are small: load, render, score."""

    name: str = "task"
    # The metric a trade-off figure plots by default; a key of the dict ``score`` returns.
    primary_metric: str = "score"
    # Whether examples can be decoded several at a time (``batch_size`` > 1); a task that scores texts by
    # teacher forcing runs them one at a time, so a batched cell of it would carry one sequence's timings.
    batchable: bool = True

    @abstractmethod
    def examples(self) -> list[Example]:
        """The examples to evaluate, already subsampled to the configured ``n`` and seed."""

    @abstractmethod
    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        """Turn an example into token ids (chat template, truncation) for ``tokenizer``."""

    @abstractmethod
    def score(self, prediction: str, example: Example) -> dict[str, float]:
        """Metric values for one prediction, higher is better unless the name says otherwise."""

    def validate(self) -> None:
        """Cheap checks (files exist, options make sense) run before any model loads."""
        return None

    def generation(self, example: Example) -> GenerationSettings:
        """Per-example generation settings; most tasks use one for all."""
        return GenerationSettings()

    def postprocess(self, text: str, example: Example) -> str:
        """Clean a raw generation before scoring (first-line cuts and the like)."""
        return text
