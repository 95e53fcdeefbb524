"""Scores, scopes and selection on small hand-written tensors, with the expected kept sets worked out by hand."""
from __future__ import annotations

import torch

from kvbench.policies.base import Policy, TokenState
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes import Everything, SinksAndWindow
from kvbench.policies.scores import RandomScore, Recency


def state(positions: list[list[int]], seed: int = 0) -> TokenState:
    pos = torch.tensor(positions)
    h, n = pos.shape
    return TokenState(keys=torch.zeros(h, n, 2), values=torch.zeros(h, n, 2), positions=pos, stats={},
                      layer_idx=0, generator=torch.Generator().manual_seed(seed))


def test_recency_keeps_newest_per_head():
    # Head 0 holds positions 0..5, head 1 holds a sparser set; budget 3 keeps the three largest positions.
    s = state([[0, 1, 2, 3, 4, 5], [0, 2, 7, 8, 11, 12]])
    keep = Policy("window", Recency(), Everything()).select(s, 3)
    assert keep.tolist() == [[3, 4, 5], [3, 4, 5]]
    assert s.positions.gather(1, keep).tolist() == [[3, 4, 5], [8, 11, 12]]


def test_sinks_and_window_protects_first_and_last():
    # 10 tokens, budget 6, 2 sinks, window 2 -> protected {0,1} and {8,9}; recency fills the other 2 with {6,7}.
    s = state([list(range(10))])
    scope = SinksAndWindow(n_sink=2, window=2)
    assert scope.protected(s, 6).nonzero()[:, 1].tolist() == [0, 1, 8, 9]
    keep = Policy("p", Recency(), scope).select(s, 6)
    assert keep.tolist() == [[0, 1, 6, 7, 8, 9]]


def test_protection_beats_score():
    # A score that prefers the oldest tokens still cannot evict the protected recent window.
    class Oldest(Recency):
        def __call__(self, st):
            return -super().__call__(st)

    s = state([list(range(8))])
    keep = Policy("p", Oldest(), SinksAndWindow(n_sink=0, window=3)).select(s, 4)
    assert keep.tolist() == [[0, 5, 6, 7]]


def test_window_fraction_of_budget_and_sink_cap():
    scope = SinksAndWindow(n_sink=4, window=0.5)
    assert scope.window_size(10) == 5
    assert scope.window_size(6) == 2  # capped at budget - sinks
    assert scope.min_budget() == 5


def test_streamingllm_keeps_sinks_plus_recent():
    # budget 7 with 4 sinks and recency: positions 0-3 then the 3 newest.
    s = state([list(range(20)), list(range(20))])
    policy = build_policy({"name": "streamingllm", "score": "recency",
                           "scope": {"kind": "sinks_window", "n_sink": 4, "window": 0}})
    assert policy.select(s, 7).tolist() == [[0, 1, 2, 3, 17, 18, 19]] * 2


def test_random_is_seeded_uniform_and_sorted():
    s1, s2, s3 = state([list(range(50))], seed=1), state([list(range(50))], seed=1), state([list(range(50))], seed=2)
    p = Policy("random", RandomScore(), Everything())
    k1, k2, k3 = p.select(s1, 10), p.select(s2, 10), p.select(s3, 10)
    assert torch.equal(k1, k2) and not torch.equal(k1, k3)
    assert torch.equal(k1, k1.sort().values) and len(set(k1[0].tolist())) == 10
    # Uniform: over many draws every token is kept with probability budget / n = 0.2.
    counts = torch.zeros(50)
    st = state([list(range(50))], seed=3)
    for _ in range(2000):
        counts[p.select(st, 10)[0]] += 1
    assert (counts / 2000 - 0.2).abs().max() < 0.04


def test_full_never_evicts_and_unknown_parts_are_named():
    assert build_policy({"name": "full"}).evicts is False
    import pytest

    with pytest.raises(ValueError, match="unknown score 'nope'"):
        build_policy({"name": "x", "score": "nope"})
