"""Needle in a haystack (Kamradt, 2023): one "special magic number" hidden at a chosen depth of real text, at a
chosen context length in the model's own tokens; scored by exact match of the number.

A cell is one (``context_tokens``, ``depth``) point; ``experiment=niah`` sweeps both and the report draws the classic
heatmap (``kvbench.report.heatmap``). The haystack and the length are RULER's: the essay haystack
(``kvbench.tasks.ruler.haystacks``: every ``*.txt`` of ``task.haystack_dir``, or the hub's Paul Graham essays) and
the fit (``kvbench.tasks.ruler.fit``: prompt + answer tokens at most ``context_tokens``, and within 5 % below).
The needle goes at the sentence boundary nearest ``depth`` % of the haystack's tokens, so 0 puts it first and 100
last, just before the question.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import Any

from kvbench.metrics.ruler import clean_prediction
from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.prompting import chat_available, encode, render_prompt
from kvbench.tasks.registry import register_task
from kvbench.tasks.ruler.fit import check_close, largest_fitting
from kvbench.tasks.ruler.generators import Sample
from kvbench.tasks.ruler.haystacks import essay_words, random_value, sentences
from kvbench.tasks.ruler.templates import niah_wording

NEEDLE = "The special magic number for {key} is: {value}."
_NUMBER = re.compile(r"\d+")


def insertion_point(parts: list[str], depth: float, count: Callable[[str], int]) -> int:
    """The sentence boundary (0: before the first sentence, ``len(parts)``: after the last) whose tokens before it,
    ``count`` of the sentences joined by spaces, are nearest ``depth`` % of all of them; the earlier on a tie.
    Tokens before a boundary grow with it, so a bisection finds the first at or past the mark."""
    target = depth / 100 * count(" ".join(parts))
    low, high = 0, len(parts)  # the first boundary with at least ``target`` tokens before it is in [low, high]
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if count(" ".join(parts[:middle])) < target else (low, middle)
    if low > 0 and target - count(" ".join(parts[: low - 1])) <= count(" ".join(parts[:low])) - target:
        return low - 1
    return low


def exact_match(prediction: str, value: str) -> float:
    """1 when the answer's first number is the needle's value (neither a longer nor a shorter one), else 0."""
    first = _NUMBER.search(prediction)
    return float(first is not None and first.group() == value)


@register_task("niah")
@dataclass
class Niah(Task):
    """One (length, depth) cell of the needle-in-a-haystack grid; ``exact_match`` is 1 when the answer's first number
    is the needle's."""

    primary_metric = "exact_match"

    context_tokens: int = 4096  # prompt + max_new_tokens, in the model's tokenizer
    depth: float = 50.0  # percent of the haystack's tokens before the needle: 0 first, 100 last
    n: int = 10
    seed: int = 0
    haystack_dir: str | None = None  # a folder of .txt files; None: the hub's Paul Graham essays
    question_aware: bool = False  # true: the question is compressed with the context
    chat_template: bool = True
    max_new_tokens: int = 16
    _words: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise TaskError(f"task.n must be a whole number >= 1 (the prompts are generated), not {self.n!r}")
        if not 0 <= self.depth <= 100:
            raise TaskError(
                f"task.depth={self.depth} must be a percent in [0, 100] of the haystack before the needle "
                "(0: the needle first, 100: last, just before the question)"
            )
        if self.context_tokens <= self.max_new_tokens:
            raise TaskError(
                f"task.context_tokens={self.context_tokens} leaves no room for a prompt beside the answer's "
                f"{self.max_new_tokens} tokens"
            )

    def asked_length(self) -> int:
        return self.context_tokens

    def validate(self) -> None:
        """The haystack is read now, so that a missing or empty folder is refused before any model loads."""
        if not self.haystack:
            raise TaskError(f"task.haystack_dir={self.haystack_dir}: the haystack holds no words")

    @property
    def haystack(self) -> list[str]:
        """The haystack's words, in the order its files are read."""
        if self._words is None:
            self._words = essay_words(self.haystack_dir)
        return self._words

    def sentence_starts(self) -> list[int]:
        """The words that start a sentence (the first, and each after a final mark)."""
        return [0] + [i + 1 for i, word in enumerate(self.haystack[:-1]) if word[-1] in ".!?"]

    def examples(self) -> list[Example]:
        """Each example's key, value and first haystack sentence are drawn from the seed and its index alone, so
        every (length, depth) cell asks for the same needles in the same text."""
        starts = self.sentence_starts()
        out = []
        for i in range(int(self.n)):
            seed = f"niah/{self.seed}/{i}"
            content = Random(seed)
            key, value = random_value(content, "words"), random_value(content, "numbers")
            start = content.choice(starts)
            _, question, _ = niah_wording("numbers", key, True)
            meta = {"key": key, "start": start}
            out.append(
                Example(
                    id=f"niah-{i}",
                    prompt=NEEDLE.format(key=key, value=value),
                    references=[value],
                    question="" if self.question_aware else question,
                    meta=meta,
                )
            )
        return out

    def sample(self, example: Example, size: int, tokenizer: Any) -> Sample:
        """The example with ``size`` haystack words (from its first sentence on, wrapping around; the last sentence
        may be cut, as in RULER), the needle at its depth."""
        start = example.meta["start"]
        parts = sentences(" ".join(self.haystack[(start + j) % len(self.haystack)] for j in range(size)))
        at = insertion_point(parts, self.depth, lambda text: len(encode(tokenizer, text)))
        head, question, prefix = niah_wording("numbers", example.meta["key"], True)
        body = " ".join(parts[:at] + [example.prompt] + parts[at:])
        return Sample(head, body, "\n", question, prefix, example.references, [example.prompt], [round(self.depth)])

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        return self.fitted(example, tokenizer)[1]

    def fitted(self, example: Example, tokenizer: Any) -> tuple[Sample, RenderedPrompt]:
        """The example with the most haystack words whose prompt, with the answer's tokens, fits
        ``context_tokens``: its text in parts and its ids."""
        chat = chat_available(tokenizer, self.chat_template)

        def length(size: int) -> int:
            rendered = self.prompt(self.sample(example, size, tokenizer), tokenizer, chat)
            return len(rendered.input_ids) + len(rendered.suffix_ids) + self.max_new_tokens

        size = largest_fitting(length, self.context_tokens, 1, len(self.haystack))
        check_close(length(size), self.context_tokens)
        sample = self.sample(example, size, tokenizer)
        return sample, self.prompt(sample, tokenizer, chat)

    def prompt(self, sample: Sample, tokenizer: Any, chat: bool) -> RenderedPrompt:
        question = "" if self.question_aware else sample.question
        context = sample.context + sample.question if self.question_aware else sample.context
        return render_prompt(
            tokenizer, context, question, chat=chat, max_prompt_tokens=None, answer_prefix=sample.answer_prefix
        )

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def postprocess(self, text: str, example: Example) -> str:
        return clean_prediction(text)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"exact_match": exact_match(prediction, example.references[0])}
