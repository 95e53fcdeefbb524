"""HeadKV (configs/policy/profiled/headkv.yaml) against the paper's budgets in NumPy, b_lh = (1 - pool)·B +
pool·B·L·H·s_lh / Σs in whole tokens, and SnapKV's selection inside each head; the retrieval-head scores
(``kvbench-profile mode=retrieval_heads``) against a hand count of copies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, tiny_policy_cfg
from engine_run import generate, generate_batch
from family_models import FAMILIES, build, eager_replay, family_config, family_greedy
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings, Request
from kvbench.families import kv_heads, layer_windows, policy_problem
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState
from kvbench.profile.retrieval_heads import copy_scores, needle_positions

pytestmark = pytest.mark.usefixtures("one_thread")


def scores_file(path: Path, scores: np.ndarray, model: str = "tiny") -> str:
    data = {"kind": "retrieval_heads", "model": model, "layers": scores.shape[0], "kv_heads": scores.shape[1]}
    path.write_text(json.dumps(data | {"scores": scores.tolist()}), encoding="utf-8")
    return str(path)


def policy(scores: str, pool: float = 0.5, window: int = 4) -> object:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "profiled" / "headkv.yaml"))
    cfg["allocation"] |= {"scores": scores, "pool": pool}
    cfg["score"]["window"] = cfg["scope"]["window"] = window
    return build_policy(cfg)


def numpy_budgets(s: np.ndarray, budget: int, pool: float) -> np.ndarray:
    """The paper's per-head budgets, in whole tokens by the largest remainders (no clipping needed)."""
    flat = s.flatten() if s.sum() > 0 else np.ones(s.size)
    raw = (1 - pool) * budget + pool * budget * flat.size * flat / flat.sum()
    out = np.floor(raw + 1e-9)
    order = np.argsort(-(raw - out), kind="stable")
    out[order[: int(round(budget * flat.size - out.sum()))]] += 1
    return out.astype(int)


@pytest.mark.parametrize("pool", [0.0, 0.3, 0.5, 1.0])
def test_row_budgets_are_the_papers(tmp_path, pool):
    """Three layers of two heads, 40 entries each, budget 10: each row keeps b_lh, the total L·H·B; inside a row
    the highest scores."""
    rng = np.random.default_rng(1)
    s = rng.uniform(0.2, 1.0, size=(3, 2))
    p = policy(scores_file(tmp_path / "s.json", s), pool)
    n, budget = 40, 10
    entry_scores = torch.tensor(rng.normal(size=(6, n)), dtype=torch.float32)
    state = TokenState(positions=torch.arange(n).expand(6, n), stats={}, units=3, row_keys=torch.arange(6).unsqueeze(1))
    mask = p.allocation.keep_rows(entry_scores, state, budget)
    expected = numpy_budgets(s, budget, pool)
    assert mask.sum(dim=1).tolist() == expected.tolist() and expected.sum() == 60
    for row in range(6):
        top = set(np.argsort(-entry_scores[row].numpy())[: expected[row]].tolist())
        assert set(mask[row].nonzero().flatten().tolist()) == top
    if pool > 0:
        assert len(set(expected.tolist())) > 1  # the scores moved the budgets


def test_a_row_keeps_its_protected_entries_and_no_more_than_it_holds(tmp_path):
    """One head with all the score (pool 1), four rows of 12 entries, the newest 5 protected. Budget 6 (24 in
    all): the head's 24 leaves the others their windows, 5 each, and keeps 9. Budget 8 (32): the head keeps all it
    holds, 12, the other 20 are spread evenly (6⅔ each, the earlier rows rounded up)."""
    s = np.array([[1000.0, 0.0], [0.0, 0.0]])
    p = policy(scores_file(tmp_path / "s.json", s), pool=1.0)
    n = 12
    ranked = torch.zeros(4, n)
    ranked[:, -5:] = float("inf")
    state = TokenState(positions=torch.arange(n).expand(4, n), stats={}, units=2)
    for budget, expected in ((6, [9, 5, 5, 5]), (8, [12, 7, 7, 6])):
        mask = p.allocation.keep_rows(ranked, state, budget)
        assert mask.sum(dim=1).tolist() == expected
        assert bool(mask[:, -5:].all())


def test_tiny_model_rows_keep_their_budgets_nested_in_snapkvs(tiny, random_ids, tmp_path):
    """The tiny Llama's prompt at a budget of 12 (stage=prefill): each row keeps its NumPy budget, the total is
    L·H·B, resident KV bytes are the hand count, and each row's set is SnapKV's ranking cut at its own count: it
    contains SnapKV's uniform set where its count is above the budget, and lies inside it where below."""
    config = tiny.model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    s = np.random.default_rng(4).uniform(0.0, 1.0, size=(layers, heads))
    ids, budget, new = random_ids(48, seed=9), 12, 3
    p = policy(scores_file(tmp_path / "s.json", s), pool=0.5)
    settings = DecodeSettings(max_new_tokens=new)
    g = generate(tiny.model, None, ids, p, budget, "prefill", settings, trace=True)
    snap_cfg = tiny_policy_cfg("snapkv", score={"window": 4}, scope={"window": 4})
    uniform = generate(tiny.model, None, ids, build_policy(snap_cfg), budget, "prefill", settings, trace=True)
    expected = numpy_budgets(s, budget, 0.5).reshape(layers, heads)
    for layer in range(layers):
        for head in range(heads):
            ours = set(g.trace[0][layer][head].tolist())
            theirs = set(uniform.trace[0][layer][head].tolist())
            assert len(ours) == expected[layer, head], (layer, head)
            assert ours >= theirs if len(ours) >= budget else ours <= theirs, (layer, head)
    head_dim = config.hidden_size // config.num_attention_heads
    held = int(expected.sum()) + layers * heads * (new - 1)  # the decoded tokens fed after the prompt stay
    assert g.measures.kv_resident_bytes == held * head_dim * 2 * 4  # keys and values, float32


def test_batched_equals_alone(tiny, tmp_path):
    """Four sequences of other lengths, prompts fed in chunks of 8 and decoded three at a time: each gives the
    tokens and holds the resident bytes it does alone, and something was evicted."""
    config = tiny.model.config
    s = np.random.default_rng(6).uniform(size=(config.num_hidden_layers, config.num_key_value_heads))
    p = policy(scores_file(tmp_path / "s.json", s), window=4)
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(torch.randint(0, 250, (n,), generator=g).tolist(), settings=DecodeSettings(max_new_tokens=m))
        for n, m in ((40, 9), (25, 5), (33, 12), (29, 7))
    ]
    for stage in ("prefill", "both"):
        batched = generate_batch(tiny.model, None, reqs, p, 0.4, stage, batch_size=3, stride=8)
        for r, b in zip(reqs, batched):
            alone = generate(tiny.model, None, r.input_ids, p, 0.4, stage, r.settings, stride=8)
            assert b.tokens == alone.tokens and b.measures.kv_resident_bytes == alone.measures.kv_resident_bytes
            assert alone.measures.budget_achieved < 0.99


@pytest.mark.parametrize("family", list(FAMILIES))
def test_budget_of_the_sequence_length_is_the_familys_generate(family, tmp_path):
    """Every family: at a budget of the whole sequence HeadKV keeps everything, so its tokens are the family's
    own greedy ``generate``'s (scores measured for the family's layers and KV heads)."""
    model = build(family)
    config = family_config(family)
    s = np.random.default_rng(0).uniform(size=(len(layer_windows(config)), kv_heads(config)))
    p = policy(scores_file(tmp_path / "s.json", s))
    assert policy_problem(config, p) is None
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, _ = family_greedy(model, prompt, 8)
    for stage in ("prefill", "both"):
        g = generate(model, None, prompt, p, 28, stage, DecodeSettings(max_new_tokens=8))
        assert g.tokens == tokens, stage


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eviction_equals_the_familys_eager_attention_masked_to_the_kept_set(family, tmp_path):
    """Every family, evicting (budget 6 of 20 prompt tokens, split unevenly over the heads): kvbench's logits are
    the family's eager attention's over transformers' own cache, masked to the positions each head kept."""
    model = build(family)
    config = family_config(family)
    s = np.random.default_rng(2).uniform(size=(len(layer_windows(config)), kv_heads(config))) ** 3
    p = policy(scores_file(tmp_path / "s.json", s), pool=0.75, window=2)
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    for stage, stride in (("prefill", None), ("both", 7)):
        settings = DecodeSettings(max_new_tokens=8)
        g = generate(model, None, prompt, p, 6, stage, settings, stride=stride, return_logits=True, trace=True)
        replayed = eager_replay(model, prompt, g.tokens, g.trace, stride)
        torch.testing.assert_close(g.logits, replayed, rtol=1e-4, atol=1e-4, msg=f"{family} {stage}")


def test_scores_of_another_model_are_refused_before_it_runs(tmp_path):
    p = policy(scores_file(tmp_path / "s.json", np.ones((2, 1)), model="other"))
    problem = policy_problem(family_config("llama"), p)
    assert problem is not None and "measured on other (2 layers of 1 KV heads)" in problem


@pytest.mark.parametrize(
    "allocation, message",
    [
        (
            {"scores": "missing.json"},
            "allocation scores 'missing.json' is not a file; measure them with kvbench-profile",
        ),
        ({"pool": 1.5}, "pool=1.5 must be in [0, 1]"),
    ],
)
def test_bad_options_are_refused(tmp_path, allocation, message):
    good = scores_file(tmp_path / "s.json", np.ones((2, 1)))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        policy(**({"scores": good} | allocation))


def test_copy_scores_by_hand():
    """Prompt ``5 7 1 2 3 9 1 2 3``, answer ``1 2 3``: the needle is positions 2-4 and 6-8. Two KV heads of two
    query heads each; per answer token, where each query head looks most (its argmax), and the copies by hand."""
    prompt, answer = [5, 7, 1, 2, 3, 9, 1, 2, 3], [1, 2, 3]
    assert needle_positions(prompt, answer).nonzero()[0].tolist() == [2, 3, 4, 6, 7, 8]
    looks = [
        [2, 3, 4],  # copies all three: 1
        [6, 0, 10],  # copies 1 (at 6), misses at 0 (no needle), 10 is an answer token: 1/3
        [3, 7, 8],  # 3 holds 2, not 1; 7 holds 2 (copy); 8 holds 3 (copy): 2/3
        [5, 5, 5],  # position 5 is outside the needle: 0
    ]
    n = len(prompt) + len(answer) - 1
    attention = torch.full((4, 3, n), 0.01)
    for head, where in enumerate(looks):
        for i, j in enumerate(where):
            attention[head, i, j] = 1.0
    scores = copy_scores([attention, attention.flip(0)], prompt, answer, kv_heads=2)
    expected = np.array([(1 + 1 / 3) / 2, (2 / 3 + 0) / 2])
    np.testing.assert_allclose(scores, np.stack([expected, expected[::-1]]))
