"""CAKE (Qin et al. 2025, arXiv:2503.12491) against NumPy from the paper's equations.

Per layer, the preference P_l = H_l^(1/τ1) · V_l^(1/τ2): the entropy of the observation window's attention to the
entries before it, and their variance over the window's queries. Budgets B_l = P_l / Σ P of the layers' shared
total beyond the windows (a layer capped at what it holds, its excess spread evenly over the others, as CAKE's
authors do). Within a layer, the entries of highest mean + γ·variance of that attention (avg-pooled), the window
kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState

LAYERS, HEADS, N, WINDOW = 4, 2, 40, 6
ENTRY_BYTES = 2 * 16 * 4  # tiny-llama: a key and a value of 16 float32 per token and KV head


def cake_policy(gamma: float, tau1: float, tau2: float):
    return build_policy(
        {
            "name": "cake",
            "score": {"kind": "cake", "window": WINDOW, "kernel_size": 5, "gamma": gamma},
            "scope": {"kind": "sinks_window", "n_sink": 0, "window": WINDOW},
            "allocation": {"kind": "cake", "tau1": tau1, "tau2": tau2},
        }
    )


def numpy_cake(attention: np.ndarray, budget: int, gamma: float, tau1: float, tau2: float) -> list[list[set[int]]]:
    """attention [layers, heads, window, n]: each layer's window rows. Kept positions per layer and head."""
    prefix = attention[..., : N - WINDOW]
    entropy = np.array([-(a * np.log(a)).sum() for a in prefix])
    variance = np.array([a.var(axis=1, ddof=1).sum() for a in prefix])
    preference = entropy ** (1 / tau1) * variance ** (1 / tau2)
    shares = LAYERS * (budget - WINDOW) * preference / preference.sum()
    room = N - WINDOW  # a layer keeps at most what it holds; the excess goes evenly to the others
    while (shares > room + 1e-9).any():
        excess = (shares - room).clip(min=0).sum()
        shares = shares.clip(max=room)
        shares[shares < room] += excess / (shares < room).sum()
    whole = np.floor(shares).astype(int)
    for i in np.argsort(-(shares - whole), kind="stable")[: LAYERS * (budget - WINDOW) - whole.sum()]:
        whole[i] += 1  # the largest remainders
    kept = []
    for layer in range(LAYERS):
        indicator = prefix[layer].mean(axis=1) + gamma * prefix[layer].var(axis=1, ddof=1)  # [heads, n - window]
        padded = np.pad(indicator, ((0, 0), (2, 2)))
        pooled = sum(padded[:, i : i + N - WINDOW] for i in range(5)) / 5
        window = set(range(N - WINDOW, N))
        kept.append([set(np.argsort(-row, kind="stable")[: whole[layer]].tolist()) | window for row in pooled])
    return kept


@pytest.mark.parametrize(("gamma", "tau1", "tau2"), [(200.0, 1.0, 1.0), (0.0, 1.6, 0.4), (50.0, 0.5, 2.0)])
@pytest.mark.parametrize("budget", [10, 16, 25])
def test_kept_sets_are_the_papers(gamma: float, tau1: float, tau2: float, budget: int) -> None:
    g = torch.Generator().manual_seed(int(budget + 10 * tau1))
    # layers of different spread: the sharper a layer's softmax, the lower its entropy
    logits = torch.randn(LAYERS, HEADS, WINDOW, N, generator=g, dtype=torch.float64)
    logits = logits * torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64).view(-1, 1, 1, 1)
    attention = logits.softmax(dim=-1)
    count = (N - torch.arange(N, dtype=torch.float32)).expand(LAYERS * HEADS, N)
    state = TokenState(
        positions=torch.arange(N).expand(LAYERS * HEADS, N),
        stats={"qlog": attention.float().reshape(LAYERS * HEADS, WINDOW, N), "count": count},
        units=LAYERS,
    )
    got = cake_policy(gamma, tau1, tau2).keep_mask(state, budget)
    expected = numpy_cake(attention.float().double().numpy(), budget, gamma, tau1, tau2)
    for layer in range(LAYERS):
        for head in range(HEADS):
            row = got[layer * HEADS + head].nonzero().flatten().tolist()
            assert set(row) == expected[layer][head], (layer, head)
    assert int(got.sum()) == LAYERS * HEADS * budget
    assert len({int(got[i * HEADS].sum()) for i in range(LAYERS)}) > 1  # the layers really differ


def test_a_layer_is_capped_at_what_it_holds_and_the_rest_spread() -> None:
    """One layer of nearly uniform attention (high entropy) and three of a spike: the preferred layer wants more
    than it holds; it keeps everything and the others share the rest evenly."""
    attention = torch.full((LAYERS, HEADS, WINDOW, N), 1.0 / N, dtype=torch.float64)
    attention[1:] = 1e-9
    attention[1:, :, :, 3] = 1.0
    attention[0, :, 0, 0] += 1e-3  # some variance in the preferred layer
    attention[1:, :, 0, 5] += 1e-6
    count = (N - torch.arange(N, dtype=torch.float32)).expand(LAYERS * HEADS, N)
    state = TokenState(
        positions=torch.arange(N).expand(LAYERS * HEADS, N),
        stats={"qlog": attention.float().reshape(LAYERS * HEADS, WINDOW, N), "count": count},
        units=LAYERS,
    )
    got = cake_policy(0.0, 1.0, 1.0).keep_mask(state, 20)
    per_layer = [int(got[i * HEADS].sum()) for i in range(LAYERS)]
    assert per_layer[0] == N and sum(per_layer) == LAYERS * 20
    assert max(per_layer[1:]) - min(per_layer[1:]) <= 1


def test_the_config_through_the_engine_keeps_the_total(tiny, random_ids) -> None:
    """The tiny model's prompt at once: the layers keep different counts, each head of a layer the same, all of
    them together the uniform split's total, the window always."""
    policy = build_policy(tiny_policy_cfg("cake", score={"window": 4}))
    n, budget = 48, 12
    g = generate(tiny.model, None, random_ids(n, seed=4), policy, budget, "prefill", DecodeSettings(1), trace=True)
    layers = g.trace[0]
    counts = [[int((head >= 0).sum()) for head in layer] for layer in layers]
    assert sum(map(sum, counts)) == len(layers) * len(counts[0]) * budget
    assert all(len(set(c)) == 1 for c in counts)
    for layer in layers:
        for head in layer:
            assert set(range(n - 4, n)) <= set(head.tolist())


def test_resident_bytes_are_the_entries_the_rows_hold(tiny, random_ids) -> None:
    """After the prompt's eviction the rows hold what their layers' budgets keep, different per layer, and the
    resident KV bytes are those entries (counted from the kept positions) times a float32 key and value each: the
    rows store what they keep, not the most a layer may take of the shared total."""
    policy = build_policy(tiny_policy_cfg("cake", score={"window": 4}))
    n, budget = 48, 20
    g = generate(tiny.model, None, random_ids(n, seed=4), policy, budget, "prefill", DecodeSettings(1), trace=True)
    held = [[len(set(head.tolist())) for head in layer] for layer in g.trace[0]]
    assert len({sum(layer) for layer in held}) > 1  # the layers keep different counts
    assert sum(map(sum, held)) == LAYERS * HEADS * budget
    assert g.measures.kv_resident_bytes == sum(map(sum, held)) * ENTRY_BYTES


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="tau1=0"):
        cake_policy(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="gamma=-1"):
        cake_policy(-1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="observation window"):
        build_policy({"name": "c", "score": {"kind": "key_norm"}, "allocation": {"kind": "cake"}})
