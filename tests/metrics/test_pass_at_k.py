"""pass@k (Chen et al. 2021) against hand computations and against its definition: the share of the k-subsets of
the n samples that hold at least one correct sample, counted by listing them."""

from __future__ import annotations

import itertools
import math

import pytest

from kvbench.metrics.pass_at_k import pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 1 / 4),  # pass@1 is the share correct
        (4, 3, 1, 3 / 4),
        (4, 1, 2, 1 - 3 / 6),  # C(3,2)=3 of C(4,2)=6 pairs miss the one correct sample
        (5, 2, 3, 1 - 1 / 10),  # only the pair-free triple {the 3 wrong} misses: C(3,3)/C(5,3)
        (3, 0, 3, 0.0),
        (3, 1, 3, 1.0),  # k = n: any correct sample
        (10, 2, 9, 1.0),  # fewer wrong samples than k
    ],
)
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_the_combinatorial_definition():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_stable_where_binomials_overflow_floats():
    """C(2000, 1000) is about 1e600: the closed form in floats would be inf / inf."""
    n, c, k = 2000, 3, 1000
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python's integers are exact
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


def test_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)
