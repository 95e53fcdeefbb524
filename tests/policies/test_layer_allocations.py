"""``allocation=global`` (one top-k over every layer and KV head, a floor per row) and ``allocation=layers`` (a
budget per layer from a list): the rule against NumPy, the per-layer budgets, the resident bytes counted by hand,
and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate

from kvbench.engine.engine import DecodeSettings
from kvbench.families import policy_problem
from kvbench.models import tiny_llama_config
from kvbench.policies.allocations.global_topk import GlobalTopK
from kvbench.policies.allocations.layers import Layers
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS, HEADS, HEAD_DIM = 4, 2, 16  # tiny-llama: hidden 64 over 4 query heads, 2 KV heads
ENTRY_BYTES = 2 * HEAD_DIM * 4  # a key and a value of float32, per token and KV head
PROMPT = 48


def reference_global(scores: np.ndarray, lengths: np.ndarray, budget: int, floor: float) -> np.ndarray:
    """The rule, from its statement: every row r keeps its g_r best entries, g_r = min(len_r, max(protected_r,
    ⌊floor·budget⌋)) (protected entries score +inf), then the rows together keep the highest of the remaining
    scores until they hold rows × budget; nothing is evicted while they hold at most that."""
    rows, n = scores.shape
    valid = np.arange(n)[None, :] < lengths[:, None]
    if lengths.sum() <= rows * budget:
        return valid
    keep = np.zeros_like(valid)
    for r in range(rows):
        own = scores[r, : lengths[r]]
        guaranteed = min(lengths[r], max(int(np.isposinf(own).sum()), int(np.floor(floor * budget + 1e-9))))
        keep[r, np.argsort(-own, kind="stable")[:guaranteed]] = True
    rest = [(scores[r, j], r, j) for r in range(rows) for j in range(lengths[r]) if not keep[r, j]]
    rest.sort(key=lambda t: -t[0])
    for _, r, j in rest[: rows * budget - int(keep.sum())]:
        keep[r, j] = True
    return keep


@pytest.mark.parametrize("floor", [0.0, 0.2, 0.6])
@pytest.mark.parametrize("seed", range(4))
def test_global_keeps_the_top_k_of_every_row_with_a_floor(floor, seed):
    rng = np.random.default_rng(seed)
    rows, n, budget = 3 * HEADS, 20, 6  # three layers of two heads
    scores = rng.standard_normal((rows, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (rows, 1)).astype(np.float32)
    lengths = rng.integers(3, n + 1, rows)
    for r in range(rows):  # a few protected entries per row, at most the budget
        scores[r, rng.choice(lengths[r], int(rng.integers(0, min(3, lengths[r]))), replace=False)] = np.inf
    valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    got = GlobalTopK(floor).keep(torch.tensor(scores), valid, budget, units=3)
    want = reference_global(scores, lengths, budget, floor)
    assert np.array_equal(got.numpy(), want)
    if lengths.sum() > rows * budget:
        assert int(got.sum()) == rows * budget


def run_prompt(tiny, ids, cfg: dict, budget: int, probe: dict | None = None):
    """The prompt fed in one chunk at stage=prefill (one eviction, at its end), one token generated."""
    policy = build_policy(cfg)
    if probe is not None:  # record what the eviction ranks: the rows of one call, their (layer, head) keys
        scored = policy.scored

        def recording(state, budget, padding=float("-inf")):
            out = scored(state, budget, padding)
            probe.setdefault("calls", []).append((state.row_keys[:, 0].clone(), out.clone()))
            return out

        policy.scored = recording  # type: ignore[method-assign]
    settings = DecodeSettings(max_new_tokens=1)
    return generate(tiny.model, None, ids, policy, budget, "prefill", settings, trace=True)


def kept_sets(generation) -> list[list[set[int]]]:
    """Per layer and KV head, the positions held after the prompt's eviction (the trace repeats a short row's
    newest position to pad it: a set counts it once)."""
    return [[set(row.tolist()) for row in layer] for layer in generation.trace[0]]


def test_global_ranks_every_layer_of_the_sequence_together(tiny, random_ids):
    """One eviction ranks all of the layers' rows at once; its kept sets are the NumPy rule's on those scores."""
    ids, budget, probe = random_ids(PROMPT, seed=31), 10, {}
    g = run_prompt(tiny, ids, tiny_policy_cfg("global_snapkv"), budget, probe)
    (keys, ranked), *more = probe["calls"]
    assert not more and sorted(keys.tolist()) == list(range(LAYERS * HEADS))
    scores = np.full((LAYERS * HEADS, PROMPT), -np.inf, dtype=np.float32)
    scores[keys.numpy()] = ranked.numpy()
    want = reference_global(scores, np.full(LAYERS * HEADS, PROMPT), budget, 0.2)
    kept = kept_sets(g)
    for layer in range(LAYERS):
        for head in range(HEADS):
            assert kept[layer][head] == set(np.flatnonzero(want[layer * HEADS + head]).tolist()), (layer, head)
    per_layer = [sum(len(h) for h in layer) for layer in kept]
    assert sum(per_layer) == LAYERS * HEADS * budget and len(set(per_layer)) > 1  # layers really differ


def test_global_decode_steps_rank_the_layers_together_whatever_each_holds(tiny, random_ids):
    """Decoding under the key-norm score: after the prompt the layers hold different counts, and every decode step adds
    one entry per row; each step evicts the sequence's rows together back to layers × heads × budget, as the
    NumPy rule does on the scores that step ranked (a layer under its own share still joins)."""
    cfg = tiny_policy_cfg("knorm", allocation={"kind": "global", "floor": 0.2})
    policy, budget, new = build_policy(cfg), 12, 6
    calls = []
    scored = policy.scored

    def recording(state, budget, padding=float("-inf")):
        out = scored(state, budget, padding)
        calls.append((state.row_keys[:, 0].clone(), state.positions.clone(), state.valid_mask().clone(), out.clone()))
        return out

    policy.scored = recording  # type: ignore[method-assign]
    settings = DecodeSettings(max_new_tokens=new)
    g = generate(tiny.model, None, random_ids(PROMPT, seed=35), policy, budget, "both", settings, stride=8, trace=True)
    assert len(calls) == PROMPT // 8 - 1 + new - 1  # the first chunk fits; every later step evicts
    for step in g.trace[-(new - 1) :]:
        assert sum(len(set(row.tolist())) for layer in step for row in layer) == LAYERS * HEADS * budget
    keys, positions, valid, ranked = calls[-1]
    assert sorted(keys.tolist()) == list(range(LAYERS * HEADS))
    lengths = valid.sum(dim=1).numpy()
    assert len(set(lengths.tolist())) > 1  # rows of different lengths, ranked as one
    want = reference_global(ranked.numpy(), lengths, budget, 0.2)
    for row, key in enumerate(keys.tolist()):
        layer, head = divmod(key, HEADS)
        kept = set(positions[row][torch.from_numpy(want[row])].tolist())
        assert set(g.trace[-1][layer][head].tolist()) == kept, (layer, head)


@pytest.mark.parametrize("budget, counts", [(27, [48, 24, 24, 12]), (9, [16, 8, 8, 4])])
def test_layers_keep_the_listed_shares_scaled_to_the_runs_budget(tiny, random_ids, budget, counts):
    """budgets [1, 0.5, 0.5, 0.25] (mean 0.5625): at the mean's 27 tokens of 48 each layer keeps its share of the
    prompt; at 9 tokens the same shape, 4 × 9 tokens per head in all. Counted by hand."""
    cfg = tiny_policy_cfg("layers_snapkv", allocation={"kind": "layers", "budgets": [1.0, 0.5, 0.5, 0.25]})
    g = run_prompt(tiny, random_ids(PROMPT, seed=32), cfg, budget)
    assert [[len(h) for h in layer] for layer in kept_sets(g)] == [[c] * HEADS for c in counts]


@pytest.mark.parametrize(
    "cfg, budget",
    [
        (tiny_policy_cfg("global_snapkv"), 10),
        (tiny_policy_cfg("global_snapkv", allocation={"floor": 0.0}), 7),
        (tiny_policy_cfg("layers_snapkv", allocation={"kind": "layers", "budgets": [0.2, 1.0, 0.4, 0.6]}), 11),
    ],
)
def test_resident_bytes_are_the_entries_the_rows_hold(tiny, random_ids, cfg, budget):
    """The row's resident KV bytes are the held entries (counted from the kept positions) times a key and a value
    of float32 per entry: the rows store what they keep, not the budget's share of capacity."""
    g = run_prompt(tiny, random_ids(PROMPT, seed=33), cfg, budget)
    held = sum(len(h) for layer in kept_sets(g) for h in layer)
    assert held == LAYERS * HEADS * budget
    assert g.measures.kv_resident_bytes == held * ENTRY_BYTES


def test_a_budget_list_of_another_length_is_refused_before_and_at_the_engine(tiny, random_ids):
    cfg = tiny_policy_cfg("layers_snapkv", allocation={"kind": "layers", "budgets": [0.5, 0.5, 0.25]})
    policy = build_policy(cfg)
    fix = "give policy.allocation.budgets one share per layer (4 values)"
    assert fix in (policy_problem(tiny_llama_config(), policy) or "")  # from the config alone, no weights
    with pytest.raises(ValueError, match=r"lists 3 budgets; this model splits its budget over 4 layers"):
        run_prompt(tiny, random_ids(PROMPT, seed=34), cfg, 10)


@pytest.mark.parametrize("budgets", [[], [0.5, 1.5], [0.0, 0.5], [-0.25]])
def test_budget_values_outside_the_unit_interval_are_refused(budgets):
    with pytest.raises(ValueError, match=r"budgets.*\(0, 1\]"):
        Layers(budgets)


def test_global_refuses_a_merge():
    with pytest.raises(ValueError, match="ranks every layer together.*use policy.merge=false"):
        build_policy(tiny_policy_cfg("global_snapkv", merge=True))
