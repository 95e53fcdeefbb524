"""Shared prompt helpers: chat templating, middle truncation and the context/question split, so every task
renders the same way."""

from __future__ import annotations

import logging
from typing import Any

from kvbench.tasks.base import RenderedPrompt, TaskError

log = logging.getLogger("kvbench")
_NO_TEMPLATE_LOGGED: set[str] = set()


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenizer: Any, user_text: str) -> list[int]:
    """Ids of a one-turn chat ending where the assistant starts to answer."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def render_ids(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    """The prompt as ids: through the chat template when asked and available, else raw
    (with the tokenizer's own special tokens, as ``model.generate`` users would feed it).

    A base model such as Gemma 3 270M has no template: ``chat_template=true`` then falls back to
    the plain prompt (Gemma: BOS + text), said once per tokenizer in the log rather than refused.
    """
    if chat_available(tokenizer, chat_template):
        return chat_ids(tokenizer, text)
    return list(tokenizer(text)["input_ids"])


def chat_available(tokenizer: Any, chat_template: bool) -> bool:
    """Whether a prompt asked to go through the chat template can: the tokenizer has one (else said once in the
    log, and the prompt is fed as plain text)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return True
    if chat_template:
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if name not in _NO_TEMPLATE_LOGGED:
            _NO_TEMPLATE_LOGGED.add(name)
            log.info(
                "tokenizer %s has no chat template: prompts are fed as plain text with its own special tokens", name
            )
    return False


def truncate_middle(ids: list[int], max_tokens: int | None) -> tuple[list[int], bool]:
    """Keep the first and last halves when too long (LongBench's rule); report whether it cut."""
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, False
    head = max_tokens // 2
    return ids[:head] + ids[len(ids) - (max_tokens - head) :], True


def render_prompt(
    tokenizer: Any,
    context_part: str,
    question_part: str,
    *,
    chat: bool,
    max_prompt_tokens: int | None,
    answer_prefix: str = "",
) -> RenderedPrompt:
    """Token ids of ``context_part + question_part`` as one user turn, then ``answer_prefix`` as the start of the
    answer (after the chat template's assistant turn starts, its leading space dropped there).

    With a non-empty ``question_part`` the ids are split where it starts: ``suffix_ids`` hold the
    question and everything after it (the assistant-turn start of the chat template, the answer prefix), and
    ``input_ids + suffix_ids`` is always exactly the tokenisation of the whole prompt, middle-truncated
    (positions, so the split survives the cut) when longer than ``max_prompt_tokens``.
    """
    text = context_part + question_part
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # Templates may trim the content; the split point is where the question's text starts.
        split_at = text.rfind(question_part.strip()) if question_part.strip() else len(text)
        if split_at < 0:
            raise TaskError("the chat template changed the question text; cannot split context and question")
        text += answer_prefix.lstrip()
    else:
        split_at = len(context_part)
        text += answer_prefix
    if not question_part:
        split_at = len(text)
    # Rendered templates carry their own BOS; a plain prompt gets the tokenizer's specials.
    full = tokenizer.encode(text, add_special_tokens=not chat)
    head = tokenizer.encode(text[:split_at], add_special_tokens=not chat) if split_at < len(text) else full
    cut = _common_prefix(full, head)
    kept, truncated = truncate_middle(list(range(len(full))), max_prompt_tokens)
    return RenderedPrompt(
        input_ids=[full[i] for i in kept if i < cut],
        suffix_ids=[full[i] for i in kept if i >= cut],
        truncated=truncated,
        n_prompt_tokens_raw=len(full),
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the shared start: where the context's own tokenisation stops matching the whole."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
