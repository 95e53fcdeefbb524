"""Synthetic long-context retrieval: a needle hidden at a chosen depth in generated filler text.

It needs no download, its difficulty is set by the context length and the needle's depth, and its
answer is unambiguous, so it isolates what an eviction policy forgets.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.prompting import chat_available, encode, render_prompt
from kvbench.tasks.registry import register_task

SUBJECTS = [
    "The river",
    "A lantern",
    "The old mill",
    "Every harbour",
    "The orchard",
    "A quiet street",
    "The library",
    "Morning fog",
    "The north road",
    "A copper kettle",
    "The market",
    "Winter light",
]
VERBS = [
    "drifts past",
    "waits beside",
    "leans toward",
    "hums near",
    "settles over",
    "turns around",
    "rests under",
    "glows behind",
    "winds through",
    "looks across",
]
OBJECTS = [
    "the stone bridge",
    "a field of barley",
    "the sleeping town",
    "the red barn",
    "an empty pier",
    "the chapel bell",
    "a row of poplars",
    "the school yard",
    "the salt marsh",
    "a wooden gate",
]
INTRO = "Below is a long text. A piece of information is hidden in it; find it and answer the question.\n\n"
CODA = [
    "as the day goes on.",
    "without a sound.",
    "and nobody minds.",
    "for a while.",
    "once again.",
    "under a grey sky.",
    "before the rain.",
    "in the usual way.",
]


def filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CODA)}"


@register_task("retrieval")
@dataclass
class RetrievalTask(Task):
    """``needle=passkey``: find a 5-digit number; ``needle=kv``: look up one key among ``n_pairs``.

    An example's ``prompt`` is its needle (the filler around it is drawn when it is rendered, to the tokenizer's
    length); the question follows the text, compressed with it, or with ``question_aware=false`` fed after the
    text has been compressed (``Example.question``), so that the policy cannot know what will be asked.
    """

    primary_metric = "accuracy"

    n: int | None = 10  # null (every example, as the shared option allows) is refused: prompts are synthetic
    seed: int = 0
    context_tokens: int = 1024
    depths: list[float] | None = None  # None: spread evenly over [0, 1]
    needle: str = "passkey"
    n_pairs: int = 4
    chat_template: bool = True
    max_new_tokens: int = 12
    question_aware: bool = True

    def __post_init__(self) -> None:
        if self.needle not in ("passkey", "kv"):
            raise TaskError(f"task.needle must be 'passkey' or 'kv', not {self.needle!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise TaskError(f"task.n must be a whole number >= 1 (synthetic prompts have no 'all'), not {self.n!r}")

    def examples(self) -> list[Example]:
        n = int(self.n or 0)  # checked in __post_init__
        depths = self.depths or [i / max(1, n - 1) for i in range(n)]
        out = []
        for i in range(n):
            rng = random.Random(f"{self.seed}-{i}")
            if self.needle == "passkey":
                value = str(rng.randint(10000, 99999))
                needle = f"The passkey is {value}. Remember it. {value} is the passkey."
                question = "What is the passkey? Answer with the number only."
            else:
                keys = [
                    f"{rng.choice(SUBJECTS).split()[-1].lower()}-{rng.randint(100, 999)}" for _ in range(self.n_pairs)
                ]
                values = [str(rng.randint(10000, 99999)) for _ in keys]
                target = rng.randrange(self.n_pairs)
                value = values[target]
                needle = " ".join(f"The value of key {k} is {v}." for k, v in zip(keys, values))
                question = f"What is the value of key {keys[target]}? Answer with the number only."
            out.append(
                Example(
                    id=f"{self.needle}-{i}",
                    prompt=needle,
                    references=[value],
                    question="" if self.question_aware else question,
                    meta={
                        "depth": float(depths[i % len(depths)]),
                        "question": question,
                        "rng_seed": f"{self.seed}-{i}",
                    },
                )
            )
        return out

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        """Grow filler until the prompt reaches ``context_tokens``, then trim whole sentences to fit."""
        rng = random.Random(example.meta["rng_seed"] + "-filler")
        overhead = len(encode(tokenizer, INTRO + example.prompt + "\n\n" + example.meta["question"]))
        sentences: list[str] = []
        used = 0
        while used < self.context_tokens - overhead:
            sentences.append(filler_sentence(rng))
            used += len(encode(tokenizer, " " + sentences[-1]))
        prompt = self._render(example, tokenizer, sentences)
        while len(prompt.input_ids) + len(prompt.suffix_ids) > self.context_tokens and sentences:
            sentences.pop()
            prompt = self._render(example, tokenizer, sentences)
        return prompt

    def _render(self, example: Example, tokenizer: Any, sentences: list[str]) -> RenderedPrompt:
        """The text with the needle at its depth, then the question: apart (as the suffix) or not."""
        at = round(example.meta["depth"] * len(sentences))
        context = INTRO + " ".join(sentences[:at] + [example.prompt] + sentences[at:])
        question = "\n\n" + example.meta["question"]
        chat = chat_available(tokenizer, self.chat_template)
        if example.question:
            return render_prompt(tokenizer, context, question, chat=chat, max_prompt_tokens=None)
        return render_prompt(tokenizer, context + question, "", chat=chat, max_prompt_tokens=None)

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.references[0]
        numbers = re.findall(r"\d+", prediction)
        return {
            "accuracy": float(value in numbers),
            "exact_match": float(prediction.strip().rstrip(".") == value),
        }
