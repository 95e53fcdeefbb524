"""Shared prompt helpers: chat templating and middle truncation, so every task renders the same way."""

from __future__ import annotations

import logging
from typing import Any

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
    if chat_template and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, text)
    if chat_template:
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if name not in _NO_TEMPLATE_LOGGED:
            _NO_TEMPLATE_LOGGED.add(name)
            log.info(
                "tokenizer %s has no chat template: prompts are fed as plain text with its own special tokens", name
            )
    return list(tokenizer(text)["input_ids"])


def truncate_middle(ids: list[int], max_tokens: int | None) -> tuple[list[int], bool]:
    """Keep the first and last halves when too long (LongBench's rule); report whether it cut."""
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, False
    head = max_tokens // 2
    return ids[:head] + ids[len(ids) - (max_tokens - head) :], True
