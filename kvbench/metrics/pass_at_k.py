"""pass@k from n samples of which c are correct: Chen et al. 2021's unbiased estimator, 1 - C(n-c, k) / C(n, k),
computed as a product of ratios so that no binomial coefficient is formed (they overflow floats for long runs)."""

from __future__ import annotations

from kvbench.metrics.registry import register_metric

PASS_AT_1, PASS_AT_K = "pass@1", "pass@k"
register_metric(PASS_AT_1, higher_is_better=True, label="pass@1")
register_metric(PASS_AT_K, higher_is_better=True, label="pass@k (k = n_samples)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from the ``n`` is correct.
    C(n-c, k) / C(n, k) = prod over i in (n-c, n] of (1 - k / i); when fewer than ``k`` are wrong it is 0."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    none_correct = 1.0
    for i in range(n - c + 1, n + 1):
        none_correct *= 1.0 - k / i
    return 1.0 - none_correct
