"""lm-eval's requests as token ids, tokenised the way lm-eval's ``hf`` model tokenises them, so that a
``policy=full`` cell sees exactly the ids lm-eval's own run sees.

lm-eval's conventions (``lm_eval.models.huggingface``, ``lm_eval.api.model``): a context gets the tokenizer's own
special tokens unless its text already starts with the prefix token's text; for a (context, continuation) pair,
the context's trailing whitespace moves to the continuation, the pair is tokenised whole and the continuation is
what follows the context's own tokens; an empty context is the prefix token (BOS, else the end token).
"""

from __future__ import annotations

from typing import Any


def prefix_token(tokenizer: Any) -> int:
    """What conditions a continuation with no context: the start token, else the end-of-text token."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("the tokenizer has neither a start nor an end token to condition an empty context on")
    return int(token)


def encode_context(tokenizer: Any, text: str) -> list[int]:
    """A prompt's ids with the tokenizer's special tokens, none added where the text starts with the prefix
    token's text already."""
    start = tokenizer.decode(prefix_token(tokenizer))
    return list(tokenizer.encode(text, add_special_tokens=not (start and text.startswith(start))))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The (context ids, continuation ids) lm-eval scores for one ``loglikelihood`` request."""
    if not context:
        ids = list(tokenizer.encode(continuation, add_special_tokens=False))
        start = prefix_token(tokenizer)
        return ([start], ids) if ids[:1] != [start] else (ids[:1], ids[1:])
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole = encode_context(tokenizer, stripped + continuation)
    head = encode_context(tokenizer, stripped)
    return head, whole[len(head) :]
