"""One context, several questions (the ``shared_context`` protocol) as the runner sees it: each question is an
example of its own (its row id ``<example>/<question>``, its references, its prompt: the context, then the
question as the suffix), and the questions of one example share the engine's one prefill of their context
(``Request.context_id``). A cell resumes question by question."""

from __future__ import annotations

from dataclasses import replace

from kvbench.tasks.base import Example, RenderedPrompt
from kvbench.tasks.protocol import SharedContextPrompt


def question_id(example: Example, question: str) -> str:
    return f"{example.id}/{question}"


def row_ids(example: Example, shares_context: bool) -> list[str]:
    """The ids of the rows an example gives: its own, or one per question."""
    if not shares_context:
        return [example.id]
    return [question_id(example, q.id) for q in example.questions]


def asked(
    examples: list[Example], rendered: dict[str, RenderedPrompt], done: frozenset[str]
) -> tuple[list[Example], dict[str, RenderedPrompt], list[str | None]]:
    """Every question not in ``done`` as an example, its prompt, and the context it shares (its example's id)."""
    out: list[Example] = []
    prompts: dict[str, RenderedPrompt] = {}
    contexts: list[str | None] = []
    for ex in examples:
        prompt = rendered[ex.id]
        assert isinstance(prompt, SharedContextPrompt), "checked when the prompts were rendered"
        for question, ids in zip(ex.questions, prompt.questions):
            qid = question_id(ex, question.id)
            if qid in done:
                continue
            meta = {**ex.meta, "question_id": question.id}
            out.append(replace(ex, id=qid, references=question.references, question=question.text, meta=meta))
            prompts[qid] = RenderedPrompt(prompt.input_ids, list(ids), prompt.truncated, prompt.n_prompt_tokens_raw)
            contexts.append(ex.id)
    return out, prompts, contexts
