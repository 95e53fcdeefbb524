"""kvbench.budget: one meaning of a budget, one rounding (up, of the decimal written), one minimum.

Every expected number is worked out by hand in the comment beside it.
"""

from __future__ import annotations

import math

import pytest
from conftest import CONFIG_DIR
from omegaconf import OmegaConf

from kvbench.budget import BudgetError, budget_tokens, parse_budget, share, too_small
from kvbench.policies.registry import build_policy


@pytest.mark.parametrize(
    "budget, reference, tokens",
    [
        (0.25, 100, 25),  # exactly 25
        (0.251, 100, 26),  # 25.1 rounds up
        (0.5, 25, 13),  # 12.5 rounds up (round-half-even would give 12)
        (0.07, 100, 7),  # exactly 7 as written; 0.07 * 100 is 7.000000000000001 in binary floats
        (0.28, 25, 7),  # exactly 7 as written; 0.28 * 25 is 7.000000000000001 in binary floats
        (0.01, 206, 3),  # 2.06 rounds up
        (1.0, 17, 17),  # the whole reference
        (1e-9, 5, 1),  # any positive fraction keeps at least one token
        (64, 100, 64),  # an int is a count of tokens
        (200, 100, 200),  # a count may exceed the reference (nothing is then evicted)
    ],
)
def test_budget_tokens(budget, reference, tokens):
    assert budget_tokens(budget, reference) == tokens


def test_the_float_product_would_round_wrongly():
    """The cases above where rounding up the binary product gives one token more than the decimal asks."""
    assert math.ceil(0.07 * 100) == 8 and math.ceil(0.28 * 25) == 8


def test_kept_share_against_kvpress_compression_ratio():
    """kvpress keeps int(n * (1 - compression_ratio)) (rounded down, ratio = share evicted); kvbench's budget is
    the share kept, rounded up. budget=0.25 of 10 tokens keeps 3 here (2.5 up) where ratio 0.75 keeps 2."""
    assert budget_tokens(0.25, 10) == 3
    assert int(10 * (1 - 0.75)) == 2


@pytest.mark.parametrize(
    "amount, whole, tokens",
    [
        (0.5, 25, 13),  # a window of half a 25-token budget: 12.5 up
        (0.5, 10, 5),
        (0.0, 25, 0),  # a fractional window may be empty
        (0, 25, 0),
        (8, 25, 8),  # a count
        (1.0, 25, 25),
    ],
)
def test_share(amount, whole, tokens):
    assert share(amount, whole) == tokens


def test_share_refuses_a_fraction_above_one():
    with pytest.raises(BudgetError, match="neither a fraction in \\[0, 1\\] nor an integer count"):
        share(1.5, 10)


@pytest.mark.parametrize(
    "value, message",
    [
        (0, "budget=0 must be at least 1 token"),
        (-3, "budget=-3 must be at least 1 token"),
        (0.0, "budget=0.0 is out of range: give a fraction in (0, 1]"),
        (1.5, "budget=1.5 is out of range"),
        (float("nan"), "budget=nan is out of range"),
        ("0.5", "budget='0.5' must be a number"),
        (True, "budget=True must be a number"),
        (None, "budget=None must be a number"),
    ],
)
def test_parse_budget_refuses(value, message):
    with pytest.raises(BudgetError) as err:
        parse_budget(value)
    assert str(err.value).startswith(message)
    with pytest.raises(BudgetError):
        budget_tokens(value, 100)


def test_parse_budget_keeps_the_kind():
    assert parse_budget(1) == 1 and isinstance(parse_budget(1), int)
    assert parse_budget(1.0) == 1.0 and isinstance(parse_budget(1.0), float)


def test_minimum_is_what_the_scope_protects_plus_one():
    # StreamingLLM protects 4 sinks: 5 tokens is the least it can honour.
    streaming = build_policy(
        {"name": "streamingllm", "score": "recency", "scope": {"kind": "sinks_window", "n_sink": 4}}
    )
    assert too_small(5, streaming) is None
    assert too_small(4, streaming) == (
        "4 tokens is below the 5 tokens policy 'streamingllm' always protects; "
        "raise the budget or lower policy.scope.n_sink / window"
    )
    # The full cache never evicts: no budget is too small for it.
    assert too_small(1, build_policy({"name": "full", "score": "none"})) is None
    # A policy that protects nothing still needs one token.
    assert too_small(0, build_policy({"name": "window", "score": "recency"})) is not None


def test_scopes_size_fractional_windows_with_the_same_rounding():
    from kvbench.policies.scopes.sinks_window import SinksWindow

    # H2O: a window of half the budget; 25 tokens -> 12.5 up = 13 recent, 12 left to the scores.
    assert SinksWindow(n_sink=0, window=0.5).window_size(25) == 13
    # Capped at what the sinks leave: 4 sinks of a 10-token budget leave 6, below the 0.9 * 10 = 9 asked.
    assert SinksWindow(n_sink=4, window=0.9).window_size(10) == 6


@pytest.mark.parametrize(
    "reference, tokens",
    [
        (4096, 128),  # 4096 / 32 exactly: 32:1, the compression kvpress's users ask for
        (8000, 250),  # exactly 250
        (100, 4),  # 3.125 rounds up
        (31, 1),  # 0.96875 rounds up: never zero
        (33, 2),  # 1.03125 rounds up
    ],
)
def test_ratios_down_to_one_in_thirty_two_round_up(reference, tokens):
    assert budget_tokens(0.03125, reference) == tokens
    assert budget_tokens(0.0625, reference) == math.ceil(reference / 16)  # 16:1, also exact in binary


def test_no_lower_bound_below_one_in_thirty_two_and_every_named_policy_takes_it_at_4k():
    """The config takes any fraction above 0; at a 4k-token prompt 1/32 is 128 tokens, more than any named policy
    always protects (the smallest budget a policy takes is per prompt: docs/budgets.md)."""
    assert parse_budget(0.03125) == 0.03125 and parse_budget(1 / 64) == 1 / 64
    for path in sorted(CONFIG_DIR.glob("policy/*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        assert too_small(budget_tokens(0.03125, 4096), build_policy(cfg)) is None, path.name
