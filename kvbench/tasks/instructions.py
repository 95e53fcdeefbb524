"""Instruction following, RoCo's decode setting: short prompts answered at length, scored by fidelity.

The prompts (``data/instructions.jsonl``: explanations, how-tos, stories, comparisons, lists, code,
letters, advice, history, science, arguments, plans, dialogue, a recipe) were written for kvbench.
They have no reference answers: the score is how closely a compressed cache reproduces the full
cache's own answer (``fidelity_rougeL``, plus next-token agreement and KL), so this task is meant
for ``stage=decode`` or ``both``, where the cache fills up with the model's own output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.datasets import sample_indices
from kvbench.tasks.jsonl import read_prompts
from kvbench.tasks.prompting import render_ids
from kvbench.tasks.registry import register_task

BUILTIN_PROMPTS = Path(__file__).resolve().parent / "data" / "instructions.jsonl"


@register_task("instructions")
@dataclass
class InstructionsTask(Task):
    primary_metric = "fidelity_rougeL"

    path: str | None = None  # None: the built-in prompts
    n: int | None = None
    seed: int = 0
    max_new_tokens: int = 256
    chat_template: bool = True
    categories: list[str] | None = None  # None: every category

    def validate(self) -> None:
        if not Path(self.prompts_path).is_file():
            raise FileNotFoundError(
                f"task.path={self.prompts_path} does not exist; point it at a JSONL file of prompts"
            )
        if self.max_new_tokens < 1:
            raise TaskError(f"task.max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def prompts_path(self) -> str:
        return self.path or str(BUILTIN_PROMPTS)

    def examples(self) -> list[Example]:
        examples = read_prompts(self.prompts_path)
        if self.categories:
            examples = [ex for ex in examples if ex.meta.get("category") in self.categories]
        return [examples[i] for i in sample_indices(len(examples), self.n, self.seed)]

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        ids = render_ids(tokenizer, example.prompt, self.chat_template)
        return RenderedPrompt(input_ids=ids, n_prompt_tokens_raw=len(ids))

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {}  # no references: the runner adds the fidelity metrics

    def postprocess(self, text: str, example: Example) -> str:
        return text.strip()
