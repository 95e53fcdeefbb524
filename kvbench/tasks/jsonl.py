"""The user's own prompts from a JSONL file: ``id``, ``prompt`` and an optional ``reference`` per line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task
from kvbench.tasks.prompting import render_ids, truncate_middle
from kvbench.tasks.registry import register_task


def read_prompts(path: str | Path) -> list[Example]:
    """Examples from a JSONL file of prompts; fields other than id, prompt and reference go to ``meta``."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task.path={path} does not exist; point task.path at a JSONL file of prompts")
    out = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" not in record:
            raise ValueError(f"{path}:{number}: every line needs a 'prompt' field")
        reference = record.get("reference")
        meta = {k: v for k, v in record.items() if k not in ("id", "prompt", "reference")}
        out.append(
            Example(
                id=str(record.get("id", number)),
                prompt=record["prompt"],
                references=[reference] if reference else [],
                meta=meta,
            )
        )
    return out


@register_task("jsonl")
class JsonlTask(Task):
    primary_metric = "rougeL"

    def __init__(
        self,
        path: str | None = None,
        chat_template: bool = True,
        n: int | None = None,
        max_new_tokens: int = 64,
        max_prompt_tokens: int | None = None,
        **_: Any,
    ):
        if not path:
            raise ValueError("task=jsonl needs task.path=<file.jsonl>")
        self.path, self.chat_template, self.n = path, chat_template, n
        self.max_new_tokens, self.max_prompt_tokens = int(max_new_tokens), max_prompt_tokens

    def validate(self) -> None:
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"task.path={self.path} does not exist; point task.path at a JSONL file of prompts")

    def examples(self) -> list[Example]:
        examples = read_prompts(self.path)
        return examples[: self.n] if self.n else examples

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        ids = render_ids(tokenizer, example.prompt, self.chat_template)
        kept, cut = truncate_middle(ids, self.max_prompt_tokens)
        return RenderedPrompt(input_ids=kept, truncated=cut, n_prompt_tokens_raw=len(ids))

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        from kvbench.metrics.rouge import rouge_l

        if not example.references:
            return {}
        return {"rougeL": rouge_l(prediction, example.references[0])}
