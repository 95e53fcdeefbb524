"""Entropy-gated ChunkKV against NumPy from kvpress's EntropyGatedChunkKVPress rule: chunks by mean score, the
important but spiky ones (score at or above the median, entropy below the median) cut to their best few, greedy
best chunk first, the budget's remainder to the best entries left."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, tiny_policy_cfg
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.entropy_gated_chunkkv import EntropyGatedChunkKV
from kvbench.policies.state import TokenState


def kvpress_kept(scores: np.ndarray, chunk: int, low: int, budget: int) -> set[int]:
    """The kept positions of one row's scores [n], written from the press's description."""
    n = len(scores)
    starts = list(range(0, n, chunk))
    means, entropies = [], []
    for s in starts:
        part = scores[s : s + chunk]
        means.append(part.mean())
        if len(part) == 1:
            entropies.append(0.0)
            continue
        shifted = part - min(part.min(), 0.0)
        p = shifted / (shifted.sum() + 1e-8)
        entropies.append(float(np.clip(-(p * np.log(p + 1e-8)).sum() / np.log(len(part)), 0.0, 1.0)))
    mean_median = np.sort(means)[(len(means) - 1) // 2]
    entropy_median = np.sort(entropies)[(len(entropies) - 1) // 2]
    kept: set[int] = set()
    left = budget
    for c in sorted(range(len(starts)), key=lambda c: -means[c]):
        if left <= 0:
            break
        size = min(chunk, n - starts[c])
        take = min(size, left)
        if means[c] >= mean_median and entropies[c] < entropy_median:
            take = min(take, low)
        best = sorted(range(starts[c], starts[c] + size), key=lambda i: -scores[i])[:take]
        kept.update(best)
        left -= take
    rest = sorted(set(range(n)) - kept, key=lambda i: -scores[i])
    return kept | set(rest[:left])


def view_of(scores: torch.Tensor) -> TokenState:
    """A state whose key norms are ``scores``: the ``key_norm`` base then scores each entry -score."""
    rows, n = scores.shape
    return TokenState(positions=torch.arange(n).expand(rows, n), stats={"key_norm": -scores})


@pytest.mark.parametrize("n", [50, 47], ids=["whole-chunks", "short-last-chunk"])
@pytest.mark.parametrize("signed", [False, True], ids=["positive", "signed"])
def test_kept_sets_are_the_press_rule(n: int, signed: bool) -> None:
    g = torch.Generator().manual_seed(n)
    scores = torch.rand(3, n, generator=g, dtype=torch.float64) ** 6  # spiky, so the gate cuts some chunks
    if signed:
        scores = scores - 0.1
    policy = Policy("e", EntropyGatedChunkKV(base="key_norm", chunk=5, low_entropy_chunk=2), All())
    view = view_of(scores.float())
    for budget in range(1, n + 1):
        got = policy.keep_mask(view, budget)
        for r in range(3):
            expected = kvpress_kept(scores[r].float().double().numpy(), 5, 2, budget)
            assert set(got[r].nonzero().flatten().tolist()) == expected, (budget, r)


def test_the_gate_cuts_a_spiky_chunk_and_spends_the_rest_on_further_chunks() -> None:
    """Chunks of 4: chunk 0 one spike (high mean, entropy 0), chunk 1 flat and high, chunk 2 flat and lower,
    chunk 3 flat and lowest (the median entropy is then the flat chunks' 1). At a budget of 8 ChunkKV would keep
    chunks 0 and 1; the gate keeps the spike, chunk 1 and 3 of chunk 2."""
    scores = torch.tensor([[9.0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5]])
    policy = Policy("e", EntropyGatedChunkKV(base="key_norm", chunk=4, low_entropy_chunk=1), All())
    got = policy.keep_mask(view_of(scores), 8)[0].nonzero().flatten().tolist()
    assert got == [0, 4, 5, 6, 7, 8, 9, 10]


def test_the_guard_is_kvpresss_on_the_heads_sum() -> None:
    """kvpress adds 1e-8 to a chunk's total of the heads' summed scores; a shared base is the heads' mean. On
    scores of the guard's size the entropies, and so the gate, depend on it: the kept sets are kvpress's only with
    the guard in kvpress's units (1e-8 / heads here)."""
    g = torch.Generator().manual_seed(0)
    scale = 10 ** (torch.rand(3, 12, 1, generator=g, dtype=torch.float64) * 3 - 10)  # chunks' totals 1e-10 to 1e-7
    scores = (torch.rand(3, 12, 5, generator=g, dtype=torch.float64) ** 3 * scale).reshape(3, 60)
    base = {"kind": "key_norm", "shared": True}
    policy = Policy("e", EntropyGatedChunkKV(base=base, chunk=5, low_entropy_chunk=2), All())
    view = view_of(scores.float())
    summed = view.stats["key_norm"].double().neg().sum(dim=0).numpy()  # the heads' sum, as kvpress reads it
    for budget in range(1, 61):
        expected = kvpress_kept(summed, 5, 2, budget)
        got = policy.keep_mask(view, budget)
        for r in range(3):
            assert set(got[r].nonzero().flatten().tolist()) == expected, (budget, r)


def test_the_configs_guard_reads_snapkvs_window() -> None:
    """The shipped config's guard is kvpress's in kvbench's units: its SnapKV base sums a 64-query window."""
    config = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "entropy_gated_chunkkv.yaml"))
    score = build_policy(config).score
    assert isinstance(score, EntropyGatedChunkKV) and score.window == 64 and score.inner.shares_heads


def test_the_config_keeps_the_budget_one_set_per_layer(tiny, random_ids) -> None:
    policy = build_policy(tiny_policy_cfg("entropy_gated_chunkkv", score={"base": {"window": 4}}))
    assert policy.unsupported_stages == ("decode",)
    g = generate(tiny.model, None, random_ids(47, seed=3), policy, 23, "prefill", DecodeSettings(1), trace=True)
    for layer in g.trace[0]:
        assert layer.shape[-1] == 23 and all(torch.equal(head, layer[0]) for head in layer)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk > low_entropy_chunk >= 1"):
        EntropyGatedChunkKV(chunk=4, low_entropy_chunk=4)
    with pytest.raises(ValueError, match="chunk > low_entropy_chunk >= 1"):
        build_policy(tiny_policy_cfg("entropy_gated_chunkkv", score={"low_entropy_chunk": 0}))
