"""R-KV against NumPy from the paper's equations: importance from the observation window's attention (softmax over
the entries before the window, mean over its queries, max-pooled), redundancy from the keys' cosine similarities
(diagonal and each key's most recent similar key left out, mean, softmax), mixed as λ·I − (1 − λ)·R."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy
from kvbench.policies.scores.rkv import RKV
from kvbench.policies.state import TokenState

ALPHA, KERNEL, LAMBDA, THRESHOLD = 3, 3, 0.3, 0.5


def numpy_rkv(
    keys: np.ndarray, queries: np.ndarray, alpha: int, kernel: int, lam: float, threshold: float
) -> np.ndarray:
    """One row: keys [n, D], the last ``alpha`` tokens' queries [alpha, D]. Scores of the n - alpha entries before
    the observation window, from the equations (loops, no shortcuts)."""
    n, d = keys.shape
    past = n - alpha
    importance = np.zeros(past)
    for q in queries:
        logits = keys[:past] @ q / np.sqrt(d)
        weights = np.exp(logits - logits.max())
        importance += weights / weights.sum()
    importance /= alpha
    half = kernel // 2
    pooled = np.array([importance[max(0, j - half) : j + half + 1].max() for j in range(past)])
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, 0.0)
    for i in range(n):
        similar = [j for j in range(n) if j != i and sim[i, j] > threshold]
        if similar:
            sim[i, max(similar)] = 0.0
    mean = sim.sum(axis=0) / n
    redundancy = np.exp(mean) / np.exp(mean).sum()
    return lam * pooled - (1 - lam) * redundancy[:past]


def causal_log(keys: torch.Tensor, queries: torch.Tensor, length: int) -> torch.Tensor:
    """The query log a layer keeps: query t (position length - alpha + t) attends keys 0..its position. [W, n]."""
    n, d = keys.shape
    rows = torch.zeros(queries.shape[0], n)
    for t, q in enumerate(queries):
        seen = length - queries.shape[0] + t + 1
        rows[t, :seen] = torch.softmax(keys[:seen] @ q / d**0.5, dim=0)
    return rows


def row_keys(n: int, d: int, seed: int) -> torch.Tensor:
    """Random keys with near-duplicates, so that each key's most recent similar key is spared for some keys."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    keys[5] = keys[1] + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    keys[n - 5] = keys[1] + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    return keys


def hand_view(lengths: list[int], d: int = 6) -> tuple[TokenState, list[tuple[np.ndarray, np.ndarray]]]:
    """Rows holding ``lengths`` entries (padded with garbage keys), their query logs and counts."""
    n = max(lengths)
    keys = torch.full((len(lengths), n, d), 7.0, dtype=torch.float64)
    log = torch.zeros(len(lengths), ALPHA, n)
    count = torch.zeros(len(lengths), n)
    held = []
    for r, m in enumerate(lengths):
        k = row_keys(m, d, seed=r)
        q = torch.randn(ALPHA, d, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)
        keys[r, :m] = k
        log[r, :, :m] = causal_log(k.float(), q.float(), m)
        count[r, :m] = m - torch.arange(m)
        held.append((k.numpy(), q.numpy()))
    valid = torch.arange(n) < torch.tensor(lengths).unsqueeze(1)
    positions = torch.arange(n).expand(len(lengths), n).masked_fill(~valid, 0)
    view = TokenState(
        keys=keys.float(),
        values=keys.float(),
        positions=positions,
        stats={"qlog": log, "count": count},
        valid=None if len(set(lengths)) == 1 else valid,
        phase="decode",
    )
    return view, held


@pytest.mark.parametrize("lengths", [[16, 16], [16, 11, 14]], ids=["uniform", "padded"])
def test_rkv_equals_numpy_from_the_equations(lengths) -> None:
    view, held = hand_view(lengths)
    scores = RKV(window=ALPHA, kernel_size=KERNEL, mix_lambda=LAMBDA, threshold=THRESHOLD)(view)
    for r, (keys, queries) in enumerate(held):
        expected = numpy_rkv(keys, queries, ALPHA, KERNEL, LAMBDA, THRESHOLD)
        np.testing.assert_allclose(scores[r, : len(expected)].double().numpy(), expected, rtol=1e-4, atol=1e-6)


def test_each_part_of_the_score_moves_it() -> None:
    """The comparison has teeth: the redundancy, the sparing of similar keys and the pooling each change scores."""
    view, held = hand_view([16])
    keys, queries = held[0]
    base = numpy_rkv(keys, queries, ALPHA, KERNEL, LAMBDA, THRESHOLD)
    for other in (
        numpy_rkv(keys, queries, ALPHA, KERNEL, 1.0, THRESHOLD) * LAMBDA,
        numpy_rkv(keys, queries, ALPHA, KERNEL, LAMBDA, 2.0),
        numpy_rkv(keys, queries, ALPHA, 1, LAMBDA, THRESHOLD),
    ):
        assert np.abs(other - base).max() > 1e-4


class Checked(RKV):
    """R-KV, each eviction's scores checked against NumPy on the rows' held keys (importance from the log)."""

    def __init__(self) -> None:
        super().__init__(window=ALPHA, kernel_size=KERNEL, mix_lambda=LAMBDA, threshold=THRESHOLD)
        self.calls = 0

    def __call__(self, view: TokenState) -> torch.Tensor:
        scores = super().__call__(view)
        self.calls += 1
        for r, m in enumerate(view.lengths().tolist()):
            keys = view.keys[r, :m].double().numpy()
            log = view.stats["qlog"][r, :, :m].double().numpy()
            window = view.stats["count"][r, :m].numpy() <= ALPHA
            past = int((~window).sum())
            assert bool(window[past:].all()), "the window's entries are the newest"
            rows = log[:, :past] / log[:, :past].sum(axis=1, keepdims=True)
            importance = rows.mean(axis=0)
            pooled = np.array([importance[max(0, j - 1) : j + 2].max() for j in range(past)])
            minus_redundancy = numpy_rkv(keys, np.zeros((ALPHA, keys.shape[1])), ALPHA, KERNEL, 0.0, THRESHOLD)
            expected = LAMBDA * pooled + (1 - LAMBDA) * minus_redundancy
            np.testing.assert_allclose(scores[r, :past].double().numpy(), expected, rtol=1e-4, atol=1e-6)
        return scores


@pytest.mark.parametrize("stage", ["decode", "both"])
def test_rkv_through_the_engine_equals_numpy_at_every_eviction(tiny, random_ids, stage) -> None:
    score = Checked()
    policy = build_policy(tiny_policy_cfg("rkv", interval=1))  # every step evicts, so every eviction is checked
    policy.score = score
    g = generate(
        tiny.model, None, random_ids(30, seed=3), policy, 12, stage, DecodeSettings(max_new_tokens=6), stride=8
    )
    assert len(g.tokens) == 6 and score.calls >= 5  # one eviction per decode step at least


def test_rkv_is_refused_for_the_prompt_alone() -> None:
    policy = build_policy(tiny_policy_cfg("rkv", interval=1))  # every step evicts, so every eviction is checked
    assert policy.unsupported_stages == ("prefill",)
    for bad in ({"window": 0}, {"kernel_size": 4}, {"mix_lambda": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RKV(**bad)
