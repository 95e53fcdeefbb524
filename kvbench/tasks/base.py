"""The task contract: where examples come from, how they become prompt ids, how predictions are scored.

A task knows nothing about caches or policies; the runner hands it a tokenizer and takes back
token ids, then hands it the generated text and takes back a dict of metric values. How an example runs
(generated, teacher-forced, or one context asked several questions) is the task's ``protocol``
(:mod:`kvbench.tasks.protocol`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.tasks.protocol import GENERATE, Protocol, RenderedPrompt

__all__ = ["Example", "GenerationSettings", "Question", "RenderedPrompt", "Task", "TaskError"]


class TaskError(ValueError):
    """An option or an example a task cannot run, raised before any model loads (when the task is built or
    validated, or while the prompts are rendered); the message says what to change. Importing it needs neither
    the engine nor torch."""


@dataclass
class Question:
    """One of several questions asked of an example's context (the ``shared_context`` protocol)."""

    id: str
    text: str
    references: list[str] = field(default_factory=list)


@dataclass
class Example:
    """One evaluation item. ``references`` may be empty (fidelity-only tasks)."""

    id: str
    prompt: str
    references: list[str] = field(default_factory=list)
    # Text appended after the compressed context when a task splits context and question
    # (``question_aware=false``); empty when the whole prompt is compressed together.
    question: str = ""
    # The questions asked, one at a time, of the one compressed context (``shared_context`` protocol only).
    questions: list[Question] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationSettings:
    """What a task asks of the decoder; the run config may override ``max_new_tokens``."""

    max_new_tokens: int = 32
    # Extra strings that end generation (LongBench's newline for samsum, for example).
    stop_strings: list[str] = field(default_factory=list)


class Task(ABC):
    """Base class of every task. Subclasses are small: load, render, score. A subclass is a dataclass whose
    fields are its options: a config's keys are typed against them (:mod:`kvbench.tasks.options`), and checks
    that need more than a type go in ``__post_init__`` (raising ``TaskError``)."""

    name: ClassVar[str] = "task"
    # The metric a trade-off figure plots by default; a key of the dict ``score`` returns.
    primary_metric: ClassVar[str] = "score"
    # How an example runs; the protocol also says whether examples may be decoded several at a time.
    protocol: ClassVar[Protocol] = GENERATE

    @abstractmethod
    def examples(self) -> list[Example]:
        """The examples to evaluate, already subsampled to the configured ``n`` and seed."""

    @abstractmethod
    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        """Turn an example into token ids (chat template, truncation) for ``tokenizer``."""

    @abstractmethod
    def score(self, prediction: str, example: Example) -> dict[str, float]:
        """Metric values for one prediction, higher is better unless the name says otherwise."""

    def asked_length(self) -> int | None:
        """The prompt + answer length in tokens the task generates its examples to, when it asks for one: checked
        against the model's limit before any prompt is rendered."""
        return None

    def validate(self) -> None:
        """Cheap checks (files exist, options make sense) run before any model loads."""
        return None

    def generation(self, example: Example) -> GenerationSettings:
        """Per-example generation settings; most tasks use one for all."""
        return GenerationSettings()

    def postprocess(self, text: str, example: Example) -> str:
        """Clean a raw generation before scoring (first-line cuts and the like)."""
        return text

    def score_nll(self, nll: list[float], nll_full: list[float]) -> dict[str, float]:
        """``likelihood`` protocol: metric values from the scored tokens' negative log-likelihoods (nats) under the
        run's policy and under the full cache."""
        raise NotImplementedError(f"task {self.name} declares protocol {self.protocol.name}, not likelihood")

    def score_continuations(self, example: Example, results: list[tuple[float, bool]]) -> dict[str, float]:
        """``continuations`` protocol: metric values from each pair's summed log-likelihood (nats) and whether greedy
        decoding would have produced the continuation, in the order of the prompt's pairs."""
        raise NotImplementedError(f"task {self.name} declares protocol {self.protocol.name}, not continuations")

    def use_model(self, model: dict[str, Any]) -> None:
        """The run's model config (no weights), given before ``validate`` and ``examples``: for a task whose examples
        depend on the model (lm-eval's synthetic tasks size their data with its tokenizer). Most tasks ignore it."""
        return None
