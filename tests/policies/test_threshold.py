"""The threshold allocation (DMS-style): an entry that has left its row's window is evicted when its score is below
the threshold, whatever the budget (which only caps a row); rows then hold what they kept, and the run reports it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.allocations.threshold import Threshold
from kvbench.policies.registry import build_policy

SCORES = np.array(
    [
        [0.9, 0.1, 0.5, 0.2, 0.7, 0.0, 0.3],
        [0.2, 0.8, 0.1, 0.6, 0.0, 0.0, 0.0],  # 4 entries, then padding
        [0.4, np.inf, 0.1, 0.3, 0.1, 0.2, 0.0],  # a protected entry (+inf)
    ]
)
LENGTHS = [7, 4, 7]


def numpy_threshold(scores: np.ndarray, length: int, threshold: float, window: int, cap: int) -> set[int]:
    """One row by the rule: the newest min(window, cap) entries and every other entry scoring at least the
    threshold; over the cap, the protected (infinite) and newest entries first (the newer first among them),
    then the highest scores."""
    recent = set(range(max(0, length - min(window, cap)), length))
    passing = [i for i in range(length) if i in recent or scores[i] >= threshold]
    ranked = sorted(passing, key=lambda i: (np.inf if i in recent else scores[i], i), reverse=True)
    return set(ranked[:cap])


def keep(threshold: float, window: int, cap: int) -> list[set[int]]:
    valid = torch.arange(7) < torch.tensor(LENGTHS).unsqueeze(1)
    mask = Threshold(threshold, window).keep(torch.tensor(SCORES, dtype=torch.float32), valid, cap)
    assert not bool((mask & ~valid).any()), "padding is never kept"
    return [set(row.nonzero().flatten().tolist()) for row in mask]


@pytest.mark.parametrize("threshold, window, cap", [(0.3, 2, 100), (0.3, 0, 100), (0.05, 1, 3), (0.5, 5, 4)])
def test_keep_is_the_rule_row_by_row(threshold, window, cap) -> None:
    got = keep(threshold, window, cap)
    for r, length in enumerate(LENGTHS):
        assert got[r] == numpy_threshold(SCORES[r], length, threshold, window, cap), r


def test_by_hand() -> None:
    # threshold 0.3, window 2, no cap: row 0 keeps 0.9, 0.5, 0.7 and its newest two (5, 6); row 1 (4 entries)
    # keeps 0.8, 0.6 and its newest two (2, 3); row 2 keeps 0.4, the protected entry, 0.3 and 5, 6.
    assert keep(0.3, 2, 100) == [{0, 2, 4, 5, 6}, {1, 2, 3}, {0, 1, 3, 5, 6}]
    # Capped at 3: the newest two, then the best other.
    assert keep(0.3, 2, 3) == [{0, 5, 6}, {1, 2, 3}, {1, 5, 6}]


def key_norms(model, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, every key's L2 norm [KV heads, tokens], from the model's own cache (RoPE keeps norms)."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    return [layer.keys[0].norm(dim=-1) for layer in cache.layers]


@pytest.mark.parametrize("stage", ["both", "decode"])
def test_through_the_engine_rows_keep_what_scores_and_report_it(tiny, random_ids, stage) -> None:
    """Key norm under a threshold (keep the keys of norm at most t), budget 1.0: each row holds, at the end, its
    newest ``window`` tokens and every older key of norm <= t (the model's own keys), and the measures count what
    the rows hold."""
    ids, new, window = random_ids(40, seed=9), 6, 3
    ranked = torch.cat([n.flatten() for n in key_norms(tiny.model, ids)]).sort().values
    middle = ranked[len(ranked) // 4 : 3 * len(ranked) // 4]
    gap = int((middle[1:] - middle[:-1]).argmax())
    t = float(middle[gap : gap + 2].mean())  # in the widest gap between the middle half's norms
    policy = build_policy(
        {
            "name": "threshold",
            "score": "key_norm",
            "allocation": {"kind": "threshold", "threshold": -t, "window": window},
        }
    )
    g = generate(tiny.model, None, ids, policy, 1.0, stage, DecodeSettings(max_new_tokens=new), stride=8, trace=True)
    fed = ids + g.tokens[:-1]
    norms = key_norms(tiny.model, fed)
    assert min(float((n - t).abs().min()) for n in norms) > 1e-4, "no key norm sits on the threshold"
    n = len(fed)
    counts = [[len(set(head.tolist())) for head in held] for held in g.trace[-1]]
    # Layer 0's keys come from the tokens alone (deeper keys follow what the layers below kept).
    layer = norms[0]
    for head, held in enumerate(g.trace[-1][0]):
        kept = set(held.tolist())
        expected = {p for p in range(n - window) if layer[head, p] <= t} | set(range(n - window, n))
        assert kept == expected, (head, sorted(kept ^ expected))
    assert len({c for layer_counts in counts for c in layer_counts}) > 1, "rows hold different counts"
    held = sum(sum(layer_counts) for layer_counts in counts)
    assert g.measures.kept_tokens == pytest.approx(held / len(counts[0]) / len(counts))
    assert g.measures.kept_tokens < n
    assert g.measures.kv_resident_bytes == held * 2 * tiny.model.config.head_dim * 4  # K and V, float32


def test_a_threshold_needs_a_base_score_and_its_value() -> None:
    with pytest.raises(ValueError, match="score=none has no score"):
        build_policy({"name": "full", "score": "none", "allocation": {"kind": "threshold", "threshold": 0.1}})
    with pytest.raises(ValueError, match="needs option threshold"):
        build_policy({"name": "t", "score": "key_norm", "allocation": "threshold"})
    with pytest.raises(ValueError, match="window"):
        Threshold(0.1, window=-1)
