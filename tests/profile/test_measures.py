"""The profile's measures on small hand-written attention matrices, against hand and NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.profile import measures
from kvbench.profile.consistency import bare_scores

# Two heads, four queries (positions 3..6 of a 7-token sequence), seven keys; causal rows sum to one.
ROWS = np.array(
    [
        [
            [0.5, 0.1, 0.1, 0.3, 0.0, 0.0, 0.0],
            [0.25, 0.25, 0.25, 0.125, 0.125, 0.0, 0.0],
            [0.6, 0.0, 0.0, 0.0, 0.1, 0.3, 0.0],
            [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.4],
        ],
        [
            [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
            [0.2, 0.2, 0.2, 0.1, 0.1, 0.2, 0.0],
            [0.05, 0.05, 0.1, 0.1, 0.2, 0.2, 0.3],
        ],
    ]
)
Q_POS = np.arange(3, 7)
K_POS = np.arange(7)
VISIBLE = K_POS[None, :] <= Q_POS[:, None]


def as_torch(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


def test_entropy_matches_numpy():
    with np.errstate(divide="ignore", invalid="ignore"):
        ref = -np.nansum(np.where(ROWS > 0, ROWS * np.log(ROWS), 0.0), axis=-1)
    assert np.allclose(measures.entropy(as_torch(ROWS)).numpy(), ref)
    assert measures.entropy(as_torch(ROWS))[1, 1] == 0.0  # a one-hot row has no entropy
    assert np.isclose(measures.entropy(as_torch(ROWS))[0, 3].item(), -(6 * 0.1 * np.log(0.1) + 0.4 * np.log(0.4)))


def by_age(ages: int = 5):
    return measures.by_age(as_torch(ROWS), torch.tensor(Q_POS), torch.tensor(K_POS), torch.tensor(VISIBLE), ages)


def test_sink_and_recent_mass_by_hand():
    sink = measures.mass_on(as_torch(ROWS), measures.sink_keys(torch.tensor(K_POS), n_sink=2))
    assert np.allclose(sink.numpy(), [[0.6, 0.5, 0.6, 0.2], [0.5, 0.0, 0.4, 0.1]])
    recent = measures.recent_mass(by_age()[0], 2)  # the query itself and the token before it
    assert np.allclose(recent.numpy(), [[0.4, 0.25, 0.4, 0.5], [0.5, 1.0, 0.3, 0.5]])


def test_by_age_reads_the_diagonals():
    values, seen = by_age(9)
    for i, q in enumerate(Q_POS):
        for age in range(9):
            assert bool(seen[i, age]) == (0 <= q - age)
            assert values[:, i, age].tolist() == (ROWS[:, i, q - age].tolist() if q - age >= 0 else [0.0, 0.0])


def test_coverage_fraction_matches_numpy():
    levels = (0.5, 0.9, 0.95)
    got = measures.coverage_fractions(as_torch(ROWS), torch.tensor(VISIBLE.sum(-1)), levels).numpy()
    for i, level in enumerate(levels):
        ranked = -np.sort(-ROWS, axis=-1)
        needed = (np.cumsum(ranked, axis=-1) < level - 1e-9).sum(-1) + 1
        assert np.allclose(got[i], needed / VISIBLE.sum(-1))
    # by hand: head 0, query 0 needs 0.5 + 0.3 + 0.1 to reach 0.9: 3 of its 4 keys
    assert got[1, 0, 0] == 0.75


def test_age_moments_match_numpy():
    moments = measures.age_moments(*by_age())
    std = measures.std_from_moments(moments).numpy()
    for h in range(2):
        for age in range(5):
            values = [ROWS[h, i, k] for i, q in enumerate(Q_POS) for k in K_POS if q - k == age]
            assert moments[0, h, age] == len(values)
            assert np.isclose(moments[1, h, age].item(), sum(values))
            assert np.isclose(std[h, age], np.std(values))


def test_recall_by_hand_and_at_full_budget():
    future = as_torch(ROWS.sum(axis=1))  # [H, n]: the mass of the four queries
    kept = torch.zeros(2, 7, dtype=torch.bool)
    kept[:, 0] = True
    assert np.allclose(measures.attention_recall(future, kept).numpy(), [1.45 / 4, 0.5 / 4])
    for budget in (7, 8, 100):
        assert torch.equal(measures.oracle_recall(future, budget), torch.ones(2, dtype=torch.float64))
        assert torch.allclose(
            measures.attention_recall(future, measures.top_budget(-future, budget)), torch.ones(2, dtype=torch.float64)
        )


def test_oracle_recall_is_the_best_of_every_set():
    """At every budget the oracle's recall equals the best over all subsets of that size (brute force)."""
    from itertools import combinations

    future = ROWS.sum(axis=1)
    for budget in range(1, 8):
        best = [max(future[h, list(s)].sum() for s in combinations(range(7), budget)) / future[h].sum() for h in (0, 1)]
        assert np.allclose(measures.oracle_recall(as_torch(future), budget).numpy(), best)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_beats_every_score_at_every_budget(seed):
    """Every score's kept set, on random statistics and features, recalls no more than the oracle top-B."""
    from kvbench.profile.collect import PromptEnd
    from kvbench.profile.consistency import Budgets, layer_recall

    g = torch.Generator().manual_seed(seed)
    heads, n, history = 3, 40, 32
    rows = torch.rand(heads, history, n, generator=g).softmax(dim=-1)
    stats = {
        "acc": torch.rand(heads, n, generator=g) * 5,
        "sumsq": torch.rand(heads, n, generator=g),
        "last": rows[:, -1],
        "qlog": rows,
        "qlog_nvis": torch.full((heads, history), float(n)),
    }
    w_o = torch.randn(16, heads * 8, generator=g)  # the output projection a score may read (CriticalKV's)
    keys, values = torch.randn(heads, n, 8, generator=g), torch.randn(heads, n, 8, generator=g)
    end = PromptEnd(stats, keys, values, None, {"output_projection": w_o})
    future = torch.rand(heads, n, generator=g) ** 4
    policies = bare_scores()
    tokens = list(range(1, n + 3))
    budgets = Budgets(tokens, tokens, {name: [[b] for b in tokens] for name in policies})
    recall = layer_recall(0, future, end, policies, budgets)
    for name in policies:
        assert all(r <= o + 1e-6 for r, o in zip(recall[name], recall["oracle"])), name
        assert recall[name][-3:] == pytest.approx([1.0] * 3)  # a budget at least the length keeps everything
