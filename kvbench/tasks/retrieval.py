"""Synthetic long-context retrieval: a needle hidden at a chosen depth in generated filler text.

It needs no download, its difficulty is set by the context length and the needle's depth, and its
answer is unambiguous, so it isolates what an eviction policy forgets.
"""

from __future__ import annotations

import random
import re
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task
from kvbench.tasks.prompting import encode, render_ids
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
class RetrievalTask(Task):
    """``needle=passkey``: find a 5-digit number; ``needle=kv``: look up one key among ``n_pairs``."""

    primary_metric = "accuracy"

    def __init__(
        self,
        n: int = 10,
        seed: int = 0,
        context_tokens: int = 1024,
        depths: list[float] | None = None,
        needle: str = "passkey",
        n_pairs: int = 4,
        chat_template: bool = True,
        max_new_tokens: int = 12,
        **_: Any,
    ):
        if needle not in ("passkey", "kv"):
            raise ValueError(f"task.needle must be 'passkey' or 'kv', not {needle!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"task.n must be a whole number >= 1 (synthetic prompts have no 'all'), not {n!r}")
        self.n, self.seed, self.context_tokens = int(n), int(seed), int(context_tokens)
        self.depths = list(depths) if depths else [i / max(1, self.n - 1) for i in range(self.n)]
        self.needle, self.n_pairs = needle, int(n_pairs)
        self.chat_template, self.max_new_tokens = chat_template, int(max_new_tokens)

    def examples(self) -> list[Example]:
        out = []
        for i in range(self.n):
            rng = random.Random(f"{self.seed}-{i}")
            depth = float(self.depths[i % len(self.depths)])
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
                    prompt="",
                    references=[value],
                    question=question,
                    meta={"depth": depth, "needle": needle, "rng_seed": f"{self.seed}-{i}"},
                )
            )
        return out

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        """Grow filler until the prompt reaches ``context_tokens``, then trim whole sentences to fit."""
        rng = random.Random(example.meta["rng_seed"] + "-filler")
        intro = "Below is a long text. A piece of information is hidden in it; find it and answer the question.\n\n"
        overhead = len(encode(tokenizer, intro + example.meta["needle"] + "\n\n" + example.question))
        sentences: list[str] = []
        used = 0
        while used < self.context_tokens - overhead:
            sentences.append(filler_sentence(rng))
            used += len(encode(tokenizer, " " + sentences[-1]))
        ids = self._ids(example, tokenizer, intro, sentences)
        while len(ids) > self.context_tokens and sentences:
            sentences.pop()
            ids = self._ids(example, tokenizer, intro, sentences)
        return RenderedPrompt(input_ids=ids, n_prompt_tokens_raw=len(ids))

    def _ids(self, example: Example, tokenizer: Any, intro: str, sentences: list[str]) -> list[int]:
        at = round(example.meta["depth"] * len(sentences))
        body = " ".join(sentences[:at] + [example.meta["needle"]] + sentences[at:])
        return render_ids(tokenizer, f"{intro}{body}\n\n{example.question}", self.chat_template)

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = example.references[0]
        numbers = re.findall(r"\d+", prediction)
        return {
            "accuracy": float(value in numbers),
            "exact_match": float(prediction.strip().rstrip(".") == value),
        }
