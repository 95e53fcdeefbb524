"""Finch (Corallo & Papotti 2024; kvpress's FinchPress) against NumPy from its rule: the question's queries are the
observation window, each query's attention to the context weighed by its position p, averaged over the question
(and the GQA group), every KV head keeping its top entries, the question itself kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, tiny_policy_cfg
from engine_run import generate
from hydra import compose, initialize_config_dir

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy
from kvbench.policies.state import TokenState
from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell


def numpy_finch(attention: np.ndarray, question: int, kept: int) -> list[set[int]]:
    """attention [heads, q, n]: the question's last-``question`` query rows (a KV head's group mean). Per head,
    the kept positions: the context scored by the mean over the question of p × attention (p the query's
    position), the question scored above it."""
    heads, _, n = attention.shape
    context = n - question
    weights = np.arange(context, n, dtype=np.float64)[None, :, None]
    scores = (attention[:, -question:, :context] * weights).mean(axis=1)
    out = []
    for h in range(heads):
        best = np.argsort(-scores[h], kind="stable")[: kept - question]
        out.append(set(best.tolist()) | set(range(context, n)))
    return out


def test_kept_sets_are_the_rule_on_a_hand_state() -> None:
    g = torch.Generator().manual_seed(0)
    heads, n, question, budget = 2, 24, 5, 11
    attention = torch.rand(heads, question, n, generator=g, dtype=torch.float64)
    attention = torch.tril(attention, diagonal=n - question)  # causal: query p sees keys 0..p
    attention = attention / attention.sum(dim=-1, keepdim=True)
    policy = build_policy(tiny_policy_cfg("finch"))
    nvis = torch.arange(n - question + 1, n + 1, dtype=torch.float32).expand(heads, question)
    logged = policy.score.log_rows(attention.float(), nvis)
    positions = torch.arange(n).expand(heads, n)
    state = TokenState(positions=positions, stats={"qlog": logged, "count": (n - positions).float()}, observe=question)
    got = policy.keep_mask(state, budget)
    expected = numpy_finch(attention.numpy(), question, budget)
    for h in range(heads):
        assert set(got[h].nonzero().flatten().tolist()) == expected[h], h


def eager_attentions(model, ids: list[int]) -> list[np.ndarray]:
    """Every layer's attention [query heads, n, n] over ``ids`` (eager attention, the reference only)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    return [a[0].double().numpy() for a in out]


@pytest.mark.parametrize("question", [1, 4, 9])
def test_the_tiny_models_kept_sets_are_the_rule_on_its_eager_attention(tiny, random_ids, question) -> None:
    """The context and its question (fed as the suffix) compressed together: per layer and KV head, the kept set
    is the NumPy rule's on the model's own eager attention, the question kept; each row holds the budget."""
    context, budget = random_ids(40, seed=7), 16
    ask = random_ids(question, seed=8)
    ids = context + ask
    policy = build_policy(tiny_policy_cfg("finch"))
    g = generate(tiny.model, None, context, policy, budget, "prefill", DecodeSettings(2), ask, trace=True)
    config = tiny.model.config
    group = config.num_attention_heads // config.num_key_value_heads
    for layer, att in enumerate(eager_attentions(tiny.model, ids)):
        kv = att.reshape(config.num_key_value_heads, group, len(ids), len(ids)).mean(axis=1)
        expected = numpy_finch(kv[:, -question:], question, budget)
        kept = g.trace[0][layer]
        for head, row in enumerate(kept):
            assert set(row.tolist()) == expected[head], (layer, head)
            assert len(row) == budget


def test_a_request_without_a_question_is_refused(tiny, random_ids) -> None:
    policy = build_policy(tiny_policy_cfg("finch"))
    with pytest.raises(ValueError, match="observes the prompt's question.*question_aware=false"):
        generate(tiny.model, None, random_ids(20, seed=1), policy, 8, "prefill", DecodeSettings(1))


def test_a_cell_compresses_each_prompt_with_its_question(tmp_path) -> None:
    """The runner end to end on the passkey task with its question fed apart: the prompt counted with its question
    (both compressed together), the budget kept of it, and the resident KV bytes the hand count of what the rows
    hold after the decode: the budget plus the 3 tokens decoded after the first, in 4 layers × 2 KV heads, a
    float32 key and value of 16 each."""
    overrides = ["model=tiny-llama", "task.n=2", "task.context_tokens=160", "task.max_new_tokens=4"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config = compose("config", overrides=[*overrides, "policy=finch", "budget=0.5", "task.question_aware=false"])
    run_cell(config, tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["status"] == "ok" and r["budget_tokens"] == -(-r["prompt_tokens"] // 2)  # rounded up
        assert r["kv_resident_bytes"] == (r["budget_tokens"] + 3) * 4 * 2 * (2 * 16 * 4)
