"""Dataset rows that share one context, asked as one example (``task.ask=each``, the ``shared_context`` protocol):
the context is compressed once and each row's question is asked of its own copy.

Each question's ids are the rest of its whole prompt as the one-row rendering (``question_aware=false``) tokenises
it, so both ways feed the same tokens. A prompt longer than ``max_prompt_tokens`` is cut in the middle once for all
of its context's questions, leaving room for the longest one: that question is fed exactly the one-row tokens, and a
question k tokens shorter keeps k fewer tokens of the context's end than its one-row prompt would.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvbench.tasks.base import RenderedPrompt, TaskError
from kvbench.tasks.protocol import SharedContextPrompt


def group_rows(keys: list[Hashable]) -> list[list[int]]:
    """Row indices grouped by their key (rows sharing a context), groups in the order of their first row."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def shared_prompt(asked: list[RenderedPrompt], max_prompt_tokens: int | None) -> SharedContextPrompt:
    """One context and each question's ids, from every question's uncut prompt (context ids, then suffix ids)."""
    first = asked[0].input_ids  # a tokeniser merging across the split: the context ends where all agree
    context = first[: min(_common(first, p.input_ids) for p in asked)]
    whole = [p.input_ids + p.suffix_ids for p in asked]
    questions = [ids[len(context) :] for ids in whole]
    raw, longest = max(len(ids) for ids in whole), max(len(q) for q in questions)
    if max_prompt_tokens is None or raw <= max_prompt_tokens:
        return SharedContextPrompt(context, questions=questions, n_prompt_tokens_raw=raw)
    head = max_prompt_tokens // 2  # LongBench's middle cut, taken once for the longest question
    tail = max_prompt_tokens - head - longest
    if tail < 0:
        raise TaskError(
            f"task.max_prompt_tokens={max_prompt_tokens} leaves no room for the context beside its longest question "
            f"({longest} tokens) in its second half; raise task.max_prompt_tokens"
        )
    kept = context[:head] + context[len(context) - tail :] if tail else context[:head]
    return SharedContextPrompt(kept, questions=questions, truncated=True, n_prompt_tokens_raw=raw)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
