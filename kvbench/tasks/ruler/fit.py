"""The largest haystack that fits: RULER's length is the prompt's tokens plus the answer's budget, in the model's
own tokenizer, at most the asked length; kvbench also asks it to be within 5 % below (a longer haystack would not
fit), so that every example is about as long as asked."""

from __future__ import annotations

from collections.abc import Callable

from kvbench.tasks.base import TaskError

SLACK = 0.05  # how far below the asked length an example may end


def largest_fitting(length_of: Callable[[int], int], limit: int, lowest: int, highest: int) -> int:
    """The largest size in [lowest, highest] whose length is at most ``limit`` (lengths grow with the size; the
    search doubles its step, then halves the gap). A ``TaskError`` when even ``lowest`` is too long."""
    seen: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in seen:
            seen[size] = length_of(size)
        return seen[size] <= limit

    if not fits(lowest):
        raise TaskError(
            f"the shortest example is {seen[lowest]} tokens (prompt + the answer's tokens), over the asked {limit}; "
            "raise task.context_tokens"
        )
    good, step = lowest, 1
    while good + step <= highest and fits(good + step):
        good += step
        step *= 2
    bad = min(good + step, highest + 1)  # too long, or past the range
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def check_close(length: int, limit: int) -> None:
    """Refuse an example that ends more than ``SLACK`` below the asked length (the haystack ran out)."""
    if length < (1 - SLACK) * limit:
        raise TaskError(
            f"the longest example that fits is {length} tokens, more than {SLACK:.0%} below the asked {limit}: "
            "the haystack is too small for this length, or grows in steps too coarse for this tokenizer (use more "
            "text in task.haystack_dir for an essay haystack, or another task.context_tokens)"
        )
