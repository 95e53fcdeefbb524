"""Math word problems from the user's own GSM8K, MATH-500 or AIME files, answered in ``\\boxed{}`` and scored with
math-verify (equivalent forms count: 1/2, 0.5 and \\frac{1}{2} are one answer). Long reasoning traces are where
decode-time eviction shows: run it with ``stage=decode`` and read ``new_tokens`` beside the score."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.metrics.registry import register_metric
from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.jsonl import parse_line
from kvbench.tasks.prompting import render_ids
from kvbench.tasks.registry import register_task

register_metric("boxed", higher_is_better=True, label="answers boxed")

# format -> (problem field, answer field), each the first of its spellings a line has.
FIELDS = {
    "gsm8k": (("question",), ("answer",)),
    "math500": (("problem",), ("answer",)),
    "aime": (("problem", "Problem"), ("answer", "Answer")),
}
ID_FIELDS = ("id", "unique_id", "ID", "Id")
INSTRUCTION = "Solve the problem step by step, then give the final answer as \\boxed{ANSWER}."


def gold_answer(fmt: str, answer: Any) -> str:
    """The reference as the file states it; GSM8K's is the number after ``####`` at the end of its solution."""
    text = str(answer).strip()
    if fmt == "gsm8k":
        if "####" not in text:
            raise ValueError("a GSM8K answer ends with '#### <number>'")
        text = text.rsplit("####", 1)[1].strip()
    return text


def read_problems(path: str, fmt: str) -> list[Example]:
    """Examples from a JSONL file in one of ``FIELDS``' formats; a line without its fields is refused by number."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task.path={path} does not exist; point task.path at a JSONL file of problems")
    problem_keys, answer_keys = FIELDS[fmt]
    out = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = parse_line(line, f"{path}:{number}")
        problem = next((record[k] for k in problem_keys if k in record), None)
        answer = next((record[k] for k in answer_keys if k in record), None)
        if not isinstance(problem, str) or answer is None:
            raise ValueError(
                f"{path}:{number}: task.format={fmt} needs fields {'/'.join(problem_keys)} and {'/'.join(answer_keys)}"
            )
        try:
            gold = gold_answer(fmt, answer)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: {err}") from None
        ident = next((record[k] for k in ID_FIELDS if k in record), number)
        out.append(Example(id=str(ident), prompt=problem, references=[gold]))
    if not out:
        raise ValueError(f"{path} holds no problems; give one JSON object per line")
    return out


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (braces balanced), or None when there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def answers_match(boxed: str, gold: str) -> bool:
    """math-verify's equivalence of a boxed answer and the reference (both parsed as LaTeX)."""
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(f"\\boxed{{{boxed}}}")))


@register_task("math")
@dataclass
class MathTask(Task):
    """Problems from ``path`` in ``format``; the prediction's last ``\\boxed{}`` is its answer."""

    primary_metric = "accuracy"

    path: str = ""
    format: str = "gsm8k"
    n: int | None = None
    chat_template: bool = True
    max_new_tokens: int = 512

    def __post_init__(self) -> None:
        if not self.path:
            raise TaskError("task=math needs task.path=<file.jsonl> (GSM8K, MATH-500 or AIME lines)")
        if self.format not in FIELDS:
            raise TaskError(f"task.format={self.format} is unknown; choose one of {', '.join(FIELDS)}")

    def validate(self) -> None:
        """Read every line now (problem files are small), so a bad one is refused before any model loads."""
        read_problems(self.path, self.format)

    def examples(self) -> list[Example]:
        examples = read_problems(self.path, self.format)
        return examples if self.n is None else examples[: self.n]

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        return RenderedPrompt(input_ids=render_ids(tokenizer, f"{example.prompt}\n\n{INSTRUCTION}", self.chat_template))

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        boxed = last_boxed(prediction)
        right = boxed is not None and answers_match(boxed, example.references[0])
        return {"accuracy": float(right), "boxed": float(boxed is not None)}
