"""What a KV budget means, in one place.

A budget is either a fraction in (0, 1] of the reference length (the prompt for stage=prefill/both, prompt plus
generated tokens for stage=decode) or an integer count of tokens >= 1. A fraction becomes tokens by rounding
UP: a positive fraction never rounds to zero tokens, and a policy never holds less than the share asked for.
The fraction is taken as the decimal the user wrote (0.07 of 100 is 7, not the 8 that ``ceil(0.07 * 100)``
gives in binary floating point). A scope's window given as a fraction of the budget is sized the same way.

The smallest budget a policy can honour is what its scope always protects plus one candidate
(``Scope.min_budget``); ``too_small`` words the refusal once for every place that checks it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

MIN_TOKENS = 1


class BudgetError(ValueError):
    """A budget (or a share) that has no meaning; the message says what to give instead."""


def budget_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a budget (the words after ``budget=value``), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number: a fraction in (0, 1] or an integer token count"
    if isinstance(value, int):
        return None if value >= MIN_TOKENS else f"must be at least {MIN_TOKENS} token (or a fraction in (0, 1])"
    if not 0.0 < value <= 1.0:
        return "is out of range: give a fraction in (0, 1] or an integer token count such as budget=512"
    return None


def parse_budget(value: Any) -> float | int:
    """The budget as given: an ``int`` token count or a ``float`` fraction; anything else is refused."""
    problem = budget_problem(value)
    if problem:
        raise BudgetError(f"budget={value!r} {problem}")
    return value if isinstance(value, int) else float(value)


def share(amount: float | int, whole: int) -> int:
    """``amount`` of ``whole`` in tokens: a float in [0, 1] is a fraction (rounded up), an int a count."""
    if isinstance(amount, float) and not isinstance(amount, bool):
        if not 0.0 <= amount <= 1.0:
            raise BudgetError(f"{amount} is neither a fraction in [0, 1] nor an integer count")
        return math.ceil(Fraction(repr(amount)) * whole)
    return int(amount)


def budget_tokens(budget: float | int, reference_length: int) -> int:
    """The budget in tokens for a sequence whose reference length is ``reference_length``."""
    return max(MIN_TOKENS, share(parse_budget(budget), reference_length))


def too_small(tokens: int, policy: Any) -> str | None:
    """Why ``tokens`` is below what ``policy`` always protects, or None when it is enough."""
    least = max(MIN_TOKENS, policy.scope.min_budget())
    if not policy.evicts or tokens >= least:
        return None
    return (
        f"{tokens} tokens is below the {least} tokens policy {policy.name!r} always protects; "
        "raise the budget or lower policy.scope.n_sink / window"
    )
