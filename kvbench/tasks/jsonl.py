"""The user's own prompts from a JSONL file: ``id``, ``prompt`` and an optional ``reference`` per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.prompting import render_ids, truncate_middle
from kvbench.tasks.registry import register_task


def read_prompts(path: str | Path) -> list[Example]:
    """Examples from a JSONL file of prompts; fields other than id, prompt and reference go to ``meta``. A line
    that is not a JSON object with a string ``prompt`` is refused with its file and line number."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task.path={path} does not exist; point task.path at a JSONL file of prompts")
    out = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = parse_line(line, f"{path}:{number}")
        if not isinstance(record.get("prompt"), str):
            raise ValueError(
                f"{path}:{number}: every line needs a 'prompt' field holding text, e.g. "
                '{"id": "q1", "prompt": "...", "reference": "..."}'
            )
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
    if not out:
        raise ValueError(f"{path} holds no prompts; give one JSON object per line")
    return out


def parse_line(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a JSON object, or a ``ValueError`` naming ``where`` (file:line) and what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); fix or remove the line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be one JSON object ({{...}}), not {type(record).__name__}")
    return record


@register_task("jsonl")
@dataclass
class JsonlTask(Task):
    primary_metric = "rougeL"

    path: str = ""
    chat_template: bool = True
    n: int | None = None
    max_new_tokens: int = 64
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise TaskError("task=jsonl needs task.path=<file.jsonl>")

    def validate(self) -> None:
        """Read every line now (prompts are small), so a bad one is refused before any model loads."""
        read_prompts(self.path)

    def examples(self) -> list[Example]:
        examples = read_prompts(self.path)
        return examples if self.n is None else examples[: self.n]

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
